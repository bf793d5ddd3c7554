"""Partial freezing and per-part learning rates inside one module.

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

from dataclasses import dataclass


@dataclass(frozen=True)
class PartGroup:
    """One ``train.modules.<m>.param_groups`` entry, resolved: the part's patterns
    and the settings that replace the module's for the parameters they match."""

    part: str
    patterns: tuple[str, ...]
    lr: float
    weight_decay: float
