"""Every hookspec is documented and exercised by some test."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from disagg import hookspecs

ROOT = Path(__file__).resolve().parents[3]
SPECS = sorted(name for name, fn in vars(hookspecs).items() if callable(fn) and hasattr(fn, "disagg_spec"))


def _test_sources() -> str:
    files = [
        *ROOT.glob("packages/*/tests/**/*.py"),
        *ROOT.glob("tests/**/*.py"),
        *ROOT.glob("examples/*/tests/**/*.py"),
    ]
    return "\n".join(f.read_text() for f in files if f.resolve() != Path(__file__).resolve())


def test_there_are_hookspecs():
    assert {
        "disagg_register_strategies",
        "disagg_register_families",
        "disagg_register_transports",
        "disagg_log_metrics",
    } <= set(SPECS)


@pytest.mark.parametrize("name", SPECS)
def test_hookspec_is_documented(name):
    fn = getattr(hookspecs, name)
    doc = inspect.getdoc(fn) or ""
    assert doc, f"hookspec {name} has no docstring"
    # what pluggy's own hookspecs document: when it is called, its arguments, firstresult or not
    assert "Called" in doc, f"hookspec {name}: say when it is called"
    assert "firstresult" in doc, f"hookspec {name}: say whether it is firstresult"
    for arg in inspect.signature(fn).parameters:
        assert arg in doc, f"hookspec {name}: argument {arg!r} is not documented"


@pytest.mark.parametrize("name", SPECS)
def test_hookspec_is_tested(name):
    assert name in _test_sources(), f"hookspec {name} is not mentioned by any test"
