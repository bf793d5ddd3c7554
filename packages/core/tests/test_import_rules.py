"""The contract layer is at the bottom: plugins use ``disagg.interfaces``,
``disagg.testing``, the tiny-model helpers (``disagg.tiny``) and ``disagg``'s
``hookimpl`` only, never the runtime (driver and actor code is core's own);
and no interface imports the runtime."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CORE = ROOT / "packages" / "core" / "src" / "disagg"
PLUGIN_SRC = [
    *(p / "src" for p in sorted((ROOT / "packages").iterdir()) if p.name != "core" and (p / "src").is_dir()),
    ROOT / "examples" / "disagg-example-plugin" / "src",
]
PLUGIN_TESTS = [p / "tests" for p in sorted((ROOT / "packages").iterdir()) if p.name != "core"]
ALLOWED_FOR_PLUGINS = ("disagg.interfaces", "disagg.testing", "disagg.tiny")


def disagg_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of a ``disagg`` module in ``path``
    (``from disagg import x`` counts as ``disagg.x`` when ``x`` is a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "disagg"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "disagg":
                out += [(node.lineno, f"disagg.{a.name}") for a in node.names]
            elif node.module.split(".")[0] == "disagg":
                out.append((node.lineno, node.module))
    return out


def plugin_violations(files: list[Path]) -> list[str]:
    bad = []
    for f in files:
        for line, mod in disagg_imports(f):
            ok = mod in ("disagg", "disagg.hookimpl", "disagg.__version__") or mod.startswith(
                ALLOWED_FOR_PLUGINS
            )
            if not ok:
                bad.append(f"{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f}:{line} imports {mod}")
    return bad


def runtime_violations(files: list[Path]) -> list[str]:
    return [
        f"{f}:{line} imports {mod}"
        for f in files
        for line, mod in disagg_imports(f)
        if mod.startswith("disagg.runtime")
    ]


def test_plugins_import_only_the_contract_layer():
    files = [f for d in PLUGIN_SRC for f in d.rglob("*.py")]
    assert files, "no plugin sources found"
    assert plugin_violations(files) == []


def test_plugin_tests_do_not_import_the_runtime():
    files = [f for d in PLUGIN_TESTS if d.is_dir() for f in d.rglob("*.py")]
    assert runtime_violations(files) == []


@pytest.mark.parametrize("layer", ["interfaces", "metrics", "testing", "hookspecs.py", "builtin"])
def test_lower_layers_do_not_import_the_runtime(layer):
    path = CORE / layer
    files = [path] if path.is_file() else list(path.rglob("*.py"))
    assert runtime_violations(files) == []


def test_the_rule_catches_a_plugin_that_imports_the_runtime(tmp_path):
    bad = tmp_path / "plugin.py"
    bad.write_text(
        "from disagg import hookimpl\n"
        "from disagg.interfaces import Strategy\n"
        "from disagg.runtime.worker import ModuleWorker\n"
        "import disagg.runtime.orchestrator\n"
        "from disagg import runtime\n"
    )
    assert plugin_violations([bad]) == [
        f"{bad}:3 imports disagg.runtime.worker",
        f"{bad}:4 imports disagg.runtime.orchestrator",
        f"{bad}:5 imports disagg.runtime",
    ]
    assert len(runtime_violations([bad])) == 3
