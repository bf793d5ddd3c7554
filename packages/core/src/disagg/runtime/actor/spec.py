"""What one rank of a module group is started with (the actor's only constructor argument)."""

from __future__ import annotations

from dataclasses import dataclass

from disagg.interfaces import Family, OptimSpec, StrategyOptions
from disagg.kit import Strategy


@dataclass(frozen=True)
class WorkerSpec:
    """One rank of one module group: which module, where it sits in its
    group's ``torch.distributed`` world, and how it trains."""

    module: str
    """The module this rank holds: ``vision``, ``audio`` or ``llm``."""
    rank: int
    """This rank's index in its group's world, ``0 .. world_size - 1``."""
    world_size: int
    """Ranks in the group: ``degree x context_parallel x replicas``."""
    degree: int
    """Ranks that share the same samples (the strategy's SP or TP size)."""
    replicas: int
    """Data-parallel copies of the module in the group."""
    family: Family
    """The model family adapter that builds, loads and exports the module."""
    strategy_cls: type[Strategy]
    """The strategy class this rank instantiates once its world is up."""
    options: StrategyOptions
    """The strategy's validated options (``parallel.<module>``'s strategy keys)."""
    optim: OptimSpec | None
    """Optimizer settings merged from ``train`` and ``train.modules.<module>``; None: frozen."""
    device: str
    """``cpu`` or ``cuda`` (``train.device`` with ``auto`` resolved)."""
    precision: str
    """The precision recipe's name (``fp32``, ``bf16``, ``bf16-pure``)."""
    seed: int
    """``train.seed``: weights are built under it, dropout draws from a per-replica seed derived from it."""
    collective_timeout_s: float = 600.0
    """How long a collective may wait for its peers (``parallel.collective_timeout_s``)."""
    context_parallel: int = 1
    """Ranks of a replica splitting each sample's sequence (``parallel.<m>.context_parallel``);
    the group then has ``degree x context_parallel x replicas`` ranks."""
