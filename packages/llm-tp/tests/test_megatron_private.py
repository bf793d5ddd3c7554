"""The private megatron-core names ``disagg_llm_tp`` uses, checked against the installed release
(``megatron-core`` is bounded, ``<0.17``, at the newest minor this passed on): a release that drops
one fails here naming it. The list is kept complete by a scan of the plugin's source for underscored
attributes of megatron's classes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "disagg_llm_tp"

#: class -> private names the plugin's subclasses call (layers.TPRowLinear: the matmul without
#: megatron's CUDA-only reduce-scatter)
PRIVATE = {"RowParallelLinear": ("_forward_impl",), "ColumnParallelLinear": ("_forward_impl",)}


def missing_names() -> list[str]:
    from megatron.core import tensor_parallel

    return [
        f"{c}.{n}"
        for c, names in PRIVATE.items()
        for n in names
        if not hasattr(getattr(tensor_parallel, c), n)
    ]


def test_megatron_still_has_every_private_name() -> None:
    import megatron.core

    assert not missing_names(), f"megatron-core {megatron.core.__version__}: gone: {missing_names()}"


def test_a_dropped_name_is_named(monkeypatch) -> None:  # noqa: ANN001
    from megatron.core.tensor_parallel import layers

    # the attribute lives on a base class: drop it there, as a release would
    owner = next(c for c in layers.RowParallelLinear.__mro__ if "_forward_impl" in vars(c))
    monkeypatch.delattr(owner, "_forward_impl")
    assert "RowParallelLinear._forward_impl" in missing_names()


def test_every_private_self_call_in_a_megatron_subclass_is_listed() -> None:
    """``self._x`` in a subclass of a megatron class, where the plugin does not define ``_x``."""
    listed = {n for names in PRIVATE.values() for n in names}
    unlisted = []
    for f in sorted(SRC.rglob("*.py")):
        tree = ast.parse(f.read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            if not any(ast.unparse(b) in PRIVATE for b in cls.bases):
                continue
            own = {n.name for n in ast.walk(cls) if isinstance(n, ast.FunctionDef)}
            own |= {
                n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            }
            for node in ast.walk(cls):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                    and re.match(r"_[^_]", node.attr)
                    and node.attr not in own | listed
                ):
                    unlisted.append(f"{f.name}:{node.lineno} self.{node.attr}")
    assert not unlisted, unlisted
