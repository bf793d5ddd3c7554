"""The contract layer is at the bottom: plugins use ``disagg.interfaces`` (contracts),
``disagg.kit`` (building blocks), ``disagg.testing``, the tiny-model helpers
(``disagg.tiny``) and ``disagg``'s ``hookimpl`` only, never the runtime (driver and
actor code is core's own); no interface imports the kit, the runtime or a plugin, the
interfaces have no import circle among themselves, and they stay small."""

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
ALLOWED_FOR_PLUGINS = ("disagg.interfaces", "disagg.kit", "disagg.testing", "disagg.tiny")
#: the contracts' size budget (issue 36: 5,328 lines in 31 files before the kit moved out)
INTERFACES_MAX_LINES = 2000


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


@pytest.mark.parametrize("layer", ["interfaces", "kit", "metrics", "testing", "hookspecs.py", "builtin"])
def test_lower_layers_do_not_import_the_runtime(layer):
    path = CORE / layer
    files = [path] if path.is_file() else list(path.rglob("*.py"))
    assert runtime_violations(files) == []


def test_the_rule_catches_a_plugin_that_imports_the_runtime(tmp_path):
    bad = tmp_path / "plugin.py"
    bad.write_text(
        "from disagg import hookimpl\n"
        "from disagg.kit import Strategy\n"
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


def module_name(path: Path, src: Path) -> str:
    """Dotted name of ``path`` under the source root ``src`` (a package's ``__init__`` is the package)."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(src: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (at any depth, lazy and
    ``TYPE_CHECKING`` imports included), from the AST of every file under ``src/package``.
    ``from pkg import x`` is an edge to ``pkg.x`` when that is a module, else to ``pkg``."""
    files = {module_name(f, src): f for f in (src / package.replace(".", "/")).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, f in files.items():
        edges = set()
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if sub in files:
                        edges.add(sub)
                    elif node.module in files:
                        edges.add(node.module)
        graph[mod] = edges - {mod}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), sorted: an import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def contract_violations(files: list[Path]) -> list[str]:
    """Imports of the kit, the runtime or a plugin package (anything ``disagg_*``) from ``files``."""
    bad = []
    for f in files:
        tree = ast.parse(f.read_text(), filename=str(f))
        mods = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        mods += [
            n.module if n.module != "disagg" else f"disagg.{a.name}"
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0
            for a in n.names
        ]
        for line_mod in sorted(set(mods)):
            if line_mod.startswith(("disagg.kit", "disagg.runtime")) or line_mod.split(".")[0].startswith(
                "disagg_"
            ):
                bad.append(f"{f.name} imports {line_mod}")
    return bad


def test_interfaces_are_contracts_only(record_property):
    """``disagg.interfaces`` sits at the bottom: no kit, runtime or plugin import, no circle
    among its modules, and at most ``INTERFACES_MAX_LINES`` lines (the size is recorded as
    the ``interfaces_lines`` property, and named in the failure message)."""
    files = sorted((CORE / "interfaces").rglob("*.py"))
    assert contract_violations(files) == []
    assert import_circles(import_graph(CORE.parent, "disagg.interfaces")) == []
    lines = sum(len(f.read_text().splitlines()) for f in files)
    record_property("interfaces_lines", lines)
    record_property("interfaces_files", len(files))
    assert lines <= INTERFACES_MAX_LINES, f"disagg.interfaces is {lines} lines in {len(files)} files"


def test_the_circle_check_catches_an_injected_circle(tmp_path):
    """A package whose ``a`` imports ``b`` at module level and ``b`` imports ``a`` lazily (the
    shape ``cost`` <-> ``cost_training`` had), and whose ``c`` imports the package that imports
    ``c``: both circles are found; an interface importing the kit is named."""
    pkg = tmp_path / "disagg" / "interfaces"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from disagg.interfaces.c import C\n")
    (pkg / "a.py").write_text("from disagg.interfaces.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from disagg.interfaces import a\n")
    (pkg / "c.py").write_text("from disagg.interfaces import Family\nimport disagg.kit.sharding\n")
    assert import_circles(import_graph(tmp_path, "disagg.interfaces")) == [
        ["disagg.interfaces", "disagg.interfaces.c"],
        ["disagg.interfaces.a", "disagg.interfaces.b"],
    ]
    assert contract_violations(sorted(pkg.glob("*.py"))) == ["c.py imports disagg.kit.sharding"]
