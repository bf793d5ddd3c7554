"""Partial freezing and per-part learning rates inside one module (applied here; the
config's resolved :class:`~disagg.interfaces.parts.PartGroup` is the contract).

A family documents named *parts* of the module its ``build`` returns
(``Family.parts()``: part name -> ``fnmatch`` patterns over parameter names),
e.g. ``tower`` and ``merger`` of a Qwen2.5-VL vision encoder. The config
(``train.modules.<m>.freeze: [tower]``, ``train.modules.<m>.param_groups:
{merger: {lr: ...}}``) names parts; core resolves them to patterns in the
module's :class:`~disagg.interfaces.OptimSpec`, and a strategy applies them to
its (possibly rewritten) module: parameter names survive parallelization, so
the patterns still match. Frozen parameters get ``requires_grad = False``:
autograd computes no gradient for them, and the optimizer never sees them, so
they hold no optimizer state.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from disagg.interfaces.parts import PartGroup


def _names(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    # remove_duplicate=False: a tied weight answers to every name it has
    # (``lm_head.weight`` and ``...embed_tokens.weight``), so either part name reaches it.
    return list(module.named_parameters(remove_duplicate=False))


def matches(name: str, patterns: tuple[str, ...] | list[str]) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


def freeze_parts(module: nn.Module, frozen: dict[str, tuple[str, ...]], where: str) -> None:
    """``requires_grad_(False)`` on every parameter of the named parts.

    ``frozen``: part name -> patterns. A part whose patterns match no parameter
    is an error (the family documented a name its module does not have, or the
    strategy renamed parameters), never a silent no-op."""
    named = _names(module)
    for part, patterns in frozen.items():
        hit = [p for n, p in named if matches(n, patterns)]
        if not hit:
            raise ValueError(
                f"{where}.freeze: part {part!r} ({', '.join(patterns)}) matches no parameter of the module"
            )
        for p in hit:
            p.requires_grad_(False)


def optimizer_groups(
    module: nn.Module, params: list[nn.Parameter], groups: tuple[PartGroup, ...], where: str
) -> list[dict[str, Any]]:
    """torch optimizer param groups over ``params`` (the trainable ones): the
    first ``groups`` entry whose patterns match a parameter's name gives its
    ``lr``/``weight_decay``; the rest keep the optimizer's defaults. Without
    groups this is one group of every parameter (the plain optimizer)."""
    if not groups:
        return [{"params": params}]
    wanted = {id(p) for p in params}
    taken: set[int] = set()
    out: list[dict[str, Any]] = []
    named = _names(module)
    for g in groups:
        mine = []
        for n, p in named:
            if id(p) in wanted and id(p) not in taken and matches(n, g.patterns):
                mine.append(p)
                taken.add(id(p))
        if not mine:
            raise ValueError(
                f"{where}.param_groups: part {g.part!r} ({', '.join(g.patterns)}) matches no trainable "
                "parameter of the module"
            )
        out.append({"params": mine, "lr": g.lr, "weight_decay": g.weight_decay})
    rest = [p for p in params if id(p) not in taken]
    if rest:
        out.insert(0, {"params": rest})
    return out
