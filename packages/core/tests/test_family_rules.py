"""Families describe themselves as data; they never branch on a strategy's name.

What a strategy needs from a family (its heads, its tensor-parallel layers, its
sequence layout) is declared in ``layer_map()`` / the ``UlyssesFamily`` hooks, and
each strategy checks its own degree against it. A family that compared the
``strategy`` argument of ``check`` with a name would close the set of strategies
it can run under (a third party's TP strategy would skip the head check).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FAMILY_FILES = sorted(
    f
    for d in [*ROOT.glob("packages/*/src/*/families"), *ROOT.glob("examples/*/src/*")]
    for f in d.rglob("*.py")
)


def strategy_name_tests(path: Path) -> list[str]:
    """``line: code`` of every comparison of the name ``strategy`` with a string."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = any(isinstance(s, ast.Name) and s.id == "strategy" for s in sides)
        strings = any(
            isinstance(s, ast.Constant)
            and isinstance(s.value, str)
            or isinstance(s, (ast.Tuple, ast.List, ast.Set))
            and any(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in s.elts)
            for s in sides
        )
        if names and strings:
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_family_tests_a_strategy_by_name():
    assert FAMILY_FILES, "no family files found"
    bad = [hit for f in FAMILY_FILES for hit in strategy_name_tests(f)]
    assert not bad, "families must declare data instead (LayerMap.attention, ...):\n" + "\n".join(bad)


def test_the_rule_sees_a_name_test(tmp_path):
    f = tmp_path / "fam.py"
    f.write_text("def check(self, strategy, degree, replicas):\n    return strategy == 'megatron_tp'\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert strategy_name_tests(f) == ["fam.py:2: strategy == 'megatron_tp'"]
    finally:
        ROOT = old
