""":class:`disagg.interfaces.RankStrategy` is exactly what core's actor uses of a strategy on
its rank: every attribute the worker, its checkpoint state and its step accounting read off a
strategy is in the protocol and every protocol member is used by them (read from their source).
Each first-party strategy, and the example plugin's, has every member, each method with the
protocol's parameters."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from disagg.interfaces import RankStrategy

ACTOR = Path(importlib.import_module("disagg.runtime.actor").__file__).parent
#: the actor's files that hold a strategy, and the names it has there
FILES = ("worker.py", "state.py", "accounting.py")
STRATEGIES = [
    ("disagg.builtin.ddp", "DDPStrategy"),
    ("disagg_vision_sp.ulysses.strategy", "UlyssesStrategy"),
    ("disagg_llm_tp.strategy", "MegatronTPStrategy"),
    ("disagg_zero.strategy", "ZeroStrategy"),
    ("disagg_example_plugin.plugin", "ExampleDDP"),
]


def _members() -> set[str]:
    methods = {n for n, v in vars(RankStrategy).items() if inspect.isfunction(v) and not n.startswith("_")}
    return methods | set(RankStrategy.__annotations__)


def _is_strategy(node: ast.expr) -> bool:
    """``self.strategy`` or a plain name ``strategy`` (the functions that take one)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "strategy" and isinstance(node.value, ast.Name) and node.value.id == "self"
    return isinstance(node, ast.Name) and node.id == "strategy"


def _used() -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    for name in FILES:
        tree = ast.parse((ACTOR / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_strategy(node.value):
                used.setdefault(node.attr, []).append(f"{name}:{node.lineno}")
            # getattr(self.strategy, "ctx", None): a member named by string
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and node.args:
                if _is_strategy(node.args[0]) and isinstance(node.args[1], ast.Constant):
                    used.setdefault(node.args[1].value, []).append(f"{name}:{node.lineno}")
    return used


def test_the_actor_uses_exactly_the_protocol():
    used = _used()
    members = _members()
    outside = {k: v for k, v in used.items() if k not in members}
    assert not outside, f"the actor uses strategy members outside RankStrategy: {outside}"
    unused = members - set(used)
    assert not unused, f"RankStrategy lists members the actor never uses: {sorted(unused)}"


@pytest.mark.parametrize(("module", "cls"), STRATEGIES, ids=[c for _, c in STRATEGIES])
def test_first_party_strategy_satisfies_the_protocol(module: str, cls: str):
    strategy = getattr(pytest.importorskip(module), cls)
    annotated = {a for k in strategy.__mro__ for a in getattr(k, "__annotations__", {})}
    for name in sorted(_members()):
        want = getattr(RankStrategy, name, None)
        if not inspect.isfunction(want):  # an attribute: declared somewhere in the class's bases
            assert name in annotated, f"{cls} declares no {name!r}"
            continue
        got = getattr(strategy, name, None)
        assert callable(got), f"{cls} has no method {name!r}"
        params = list(inspect.signature(got).parameters)
        assert params == list(inspect.signature(want).parameters), f"{cls}.{name}{params}"
