"""``disagg plugins`` reads each plugin's distribution from the entry points disagg loaded, never from
pluggy's private bookkeeping; the missing-plugin hint installs the way disagg itself was installed."""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import sys
from pathlib import Path

import pluggy
import pytest

from disagg import plugins
from disagg.cli import plugins as plugins_cli

ROOT = Path(__file__).resolve().parents[3]
SOURCES = sorted(ROOT.glob("packages/*/src")) + sorted(ROOT.glob("examples/*/src"))


def _pluggy_private_names() -> set[str]:
    """The underscore names of pluggy's manager (instance and class), as installed."""
    pm = pluggy.PluginManager("probe")
    names = set(vars(pm)) | set(dir(pluggy.PluginManager))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_pluggy_uses(path: Path) -> list[str]:
    private = _pluggy_private_names()
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        modules = []
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        out += [f"{path}:{node.lineno}: import {m}" for m in modules if m.startswith("pluggy._")]
        if isinstance(node, ast.Attribute) and node.attr in private:
            out.append(f"{path}:{node.lineno}: .{node.attr}")
    return out


def test_no_private_pluggy_names_in_any_package() -> None:
    assert len(SOURCES) >= 6, SOURCES  # core, four plugins, the example
    assert "_plugin_distinfo" in _pluggy_private_names()  # the probe sees pluggy's privates
    found = [u for src in SOURCES for f in sorted(src.rglob("*.py")) for u in private_pluggy_uses(f)]
    assert not found, "private pluggy names:\n" + "\n".join(found)


def test_the_scan_sees_a_private_use(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from pluggy._manager import DistFacade\npm._plugin_distinfo.append(1)\n")
    assert [u.split(": ", 1)[1] for u in private_pluggy_uses(bad)] == [
        "import pluggy._manager",
        "._plugin_distinfo",
    ]


@pytest.fixture
def installed_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A real distribution (``.dist-info`` on ``sys.path``) declaring a ``disagg`` entry point."""
    (tmp_path / "fakedist_plugin.py").write_text(
        "import disagg\n"
        "from disagg.builtin.ddp import DDPStrategy\n"
        "class FakeDist(DDPStrategy):\n    name = 'fakedist_sp'\n"
        "@disagg.hookimpl\ndef disagg_register_strategies(register):\n    register(FakeDist)\n"
    )
    info = tmp_path / "disagg_fakedist-7.3.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: disagg-fakedist\nVersion: 7.3.1\n")
    (info / "entry_points.txt").write_text("[disagg]\nfakedist = fakedist_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("DISAGG_PLUGINS", raising=False)
    monkeypatch.setattr(plugins, "_REGISTRY", None)
    return "fakedist"


def test_plugins_lists_each_plugins_distribution_and_version(installed_plugin, capsys) -> None:
    data = plugins_cli.report()
    rows = {p["name"]: p for p in data["plugins"]}
    assert rows[installed_plugin]["version"] == "7.3.1"
    assert rows[installed_plugin]["distribution"] == "disagg-fakedist"
    assert rows["disagg.builtin"]["distribution"] == "disagg-core"
    assert rows["disagg.builtin"]["version"] == md.version("disagg-core")
    # every installed entry point's row has its own distribution's version
    for ep in md.entry_points(group=plugins.GROUP):
        if ep.name in rows and ep.dist is not None:
            assert (rows[ep.name]["distribution"], rows[ep.name]["version"]) == (
                ep.dist.metadata["Name"],
                ep.dist.version,
            )
    assert plugins_cli.run(type("A", (), {"json": True})()) == 0
    printed = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    assert printed[installed_plugin]["version"] == "7.3.1"
    plugins_cli.run(type("A", (), {"json": False})())
    assert "fakedist 7.3.1 (disagg-fakedist)" in capsys.readouterr().out.splitlines()
    plugins.set_registry(None)


def _core(tmp_path: Path, direct_url: dict | None) -> md.Distribution:
    info = tmp_path / "disagg_core-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: disagg-core\nVersion: 0.1.0\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))
    return md.PathDistribution(info)


def _checkout(tmp_path: Path) -> Path:
    for folder, name in (("core", "disagg-core"), ("zero-backend", "disagg-zero")):
        (tmp_path / "ck" / "packages" / folder).mkdir(parents=True)
        (tmp_path / "ck" / "packages" / folder / "pyproject.toml").write_text(
            f'[build-system]\nrequires = []\n\n[project]\nname = "{name}"\nversion = "0.1.0"\n'
        )
    return tmp_path / "ck"


@pytest.mark.parametrize(
    ("editable", "expected"),
    [(True, "pip install -e {ck}/packages/zero-backend"), (False, "pip install {ck}/packages/zero-backend")],
)
def test_hint_from_a_checkout_names_its_package_dir(tmp_path: Path, editable: bool, expected: str) -> None:
    ck = _checkout(tmp_path)
    url = {"url": (ck / "packages" / "core").as_uri(), "dir_info": {"editable": editable} if editable else {}}
    core = _core(tmp_path, url)
    assert plugins.install_command("disagg-zero", core) == expected.format(ck=ck)
    # a distribution the checkout does not hold: its name
    assert plugins.install_command("disagg-nowhere", core) == "pip install disagg-nowhere"


def test_hint_from_an_index_install_names_the_distribution(tmp_path: Path) -> None:
    assert plugins.install_command("disagg-zero", _core(tmp_path, None)) == "pip install disagg-zero"
    (tmp_path / "w").mkdir()
    wheel = {"url": "https://example.org/disagg_core-0.1.0-py3-none-any.whl", "archive_info": {}}
    assert plugins.install_command("disagg-zero", _core(tmp_path / "w", wheel)) == "pip install disagg-zero"


def test_the_config_hint_is_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Validation's missing-plugin problem carries :func:`install_command`'s line."""
    from disagg.config.plugin_lookup import lookup
    from disagg.config.problems import Problems

    ck = _checkout(tmp_path)
    core = _core(tmp_path, {"url": (ck / "packages" / "core").as_uri(), "dir_info": {"editable": True}})
    monkeypatch.setattr(md, "distribution", lambda name: core if name == "disagg-core" else sys.exit(name))
    out = Problems(None)
    assert lookup(out, ("parallel", "llm", "strategy"), "strategy", "zero", {}, "disagg-zero") is None
    (problem,) = out.found
    message = str(problem)
    assert (
        f"pip install -e {ck}/packages/zero-backend" in message and "pip install disagg-zero" not in message
    )
