"""CI runs the README's test command, and that command covers every package: each plugin's
tests run in its own ``isolation`` session (queued by ``tests``), the rest in ``tests``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _noxfile() -> ast.Module:
    return ast.parse((ROOT / "noxfile.py").read_text())


def _constant(name: str) -> object:
    for node in _noxfile().body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"noxfile.py has no {name}")


def test_ci_runs_the_readme_test_command() -> None:
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if "nox" in line and "-s" in line]
    assert ci == ["python3 -m nox -s tests"]
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^nox -s tests\b.*\.ci/run", readme, re.M), "README: the test command names .ci/run"


def test_every_plugin_package_runs_in_isolation() -> None:
    plugins = sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml") if p.parent.name != "core")
    assert sorted(_constant("PLUGINS")) == plugins
    tests = next(n for n in _noxfile().body if isinstance(n, ast.FunctionDef) and n.name == "tests")
    calls = [ast.unparse(c) for c in ast.walk(tests) if isinstance(c, ast.Call)]
    notified = [c for c in calls if c.startswith("session.notify(")]
    assert any("isolation(plugin=" in c and "{plugin}" in c for c in notified), notified
    assert "for plugin in PLUGINS" in ast.unparse(tests)
    assert "session.notify('plain')" in notified, notified
    # the plugins' tests are not run a second time together: only core, the example and tests/
    (run,) = [c for c in calls if c.startswith("pytest(")]
    assert "PLUGINS" not in run and "packages/core/tests" in run, run
