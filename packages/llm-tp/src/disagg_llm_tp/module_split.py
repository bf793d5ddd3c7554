"""Family-supplied tensor-parallel splits for modules the layer map's linears cannot describe.

A :class:`~disagg.interfaces.LayerMap` names column and row linears, vocabulary layers
and replicas. A module whose split is more than that (a gated-delta-net layer: a fused
projection of unequal blocks, a depthwise convolution over its channels, per-head
parameters; :mod:`disagg_llm_tp.gdn`) is declared in ``LayerMap.extra[SPLITS]``:
``{module pattern: ModuleSplit}``. ``megatron_tp`` then

- checks the degree against each split's :meth:`ModuleSplit.problems` at validation
  (with the strategy's other checks, before any actor starts);
- counts every parameter under a matching module as declared, leaves those modules to
  the split (the layer map may still list their linears as column/row: LoRA and the
  chunked loss read the kinds from there) and calls :meth:`ModuleSplit.split` on each,
  which swaps in this rank's pieces, each parameter marked with its
  :class:`~disagg_llm_tp.layers.ShardSpec` (so loading by slices, the full-form state,
  gradient reductions and LoRA's adapters cut it like any other).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn

from disagg.interfaces import LayerMap
from disagg.interfaces.comm import CommCounter

#: ``LayerMap.extra`` key: module pattern -> :class:`ModuleSplit`
SPLITS = "megatron_tp.module_splits"


@dataclass
class SplitContext:
    """What a split needs of this rank and the strategy."""

    shard: int
    degree: int
    #: megatron-core's ``ModelParallelConfig`` for the parallel linears
    config: Any
    comm: CommCounter
    #: the sequence-parallel region (None without sequence parallelism)
    sp: Any = None
    #: row linears whose output re-enters the region (``LayerMap.sequence_parallel.reduce_scatter``)
    sp_rows: set[str] = field(default_factory=set)


class ModuleSplit(Protocol):
    def problems(self, degree: int, where: str) -> list[str]:
        """Why ``degree`` cannot split the module (each a sentence naming the allowed values)."""
        ...

    def split(self, name: str, module: nn.Module, tp: SplitContext) -> None:
        """Make ``module`` (named ``name``) this rank's piece, in place."""
        ...


def module_splits(lmap: LayerMap) -> dict[str, ModuleSplit]:
    return dict(lmap.extra.get(SPLITS, {}))


def under(patterns: dict[str, ModuleSplit]) -> tuple[str, ...]:
    """fnmatch patterns of the split modules and everything inside them."""
    return (*patterns, *(f"{p}.*" for p in patterns))
