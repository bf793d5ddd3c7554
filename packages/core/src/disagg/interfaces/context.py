"""What a strategy knows about the rank it runs on."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from disagg.interfaces.comm import CommCounter
from disagg.interfaces.lora import LoraSpec
from disagg.interfaces.parts import PartGroup
from disagg.interfaces.precision import RECIPES, Recipe


@dataclass(frozen=True)
class OptimSpec:
    """Resolved optimizer settings for one module (train.* merged with train.modules.<m>.*)."""

    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    scheduler: str = "constant"  # any transformers.get_scheduler kind
    warmup_steps: int = 0
    total_steps: int = 1
    #: ``train.modules.<m>.freeze: [part, ...]`` resolved: (part, its parameter-name
    #: patterns) pairs; those parameters get no gradient and no optimizer state
    frozen: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: ``train.modules.<m>.param_groups`` resolved, in config order (first match wins)
    groups: tuple[PartGroup, ...] = ()
    #: ``train.modules.<m>.lora`` resolved: core injects these adapters after
    #: ``Family.build`` and freezes the base; None: every weight trains
    lora: LoraSpec | None = None


@dataclass
class GroupContext:
    """One rank of a module group.

    Rank layout is fixed by core:
    ``rank = replica * (degree * context_parallel) + cp_rank * degree + shard``. Ranks of
    one replica (same samples) are contiguous, and inside a replica the ranks that hold
    the same tokens (one SP/TP group) are contiguous too; a strategy builds its
    sub-groups from :meth:`shard_ranks` / :meth:`cp_peers` / :meth:`replica_peers`. To
    core (routing, which rank returns embedding gradients) every rank of a replica is one
    of its "shards": they all read the replica's samples. The default
    ``torch.distributed`` process group is exactly this module's group.
    """

    module: str
    rank: int
    world_size: int
    degree: int
    replicas: int
    device: torch.device
    #: the compute dtype: the recipe's ``weights`` (activations, tensors sent to other groups)
    dtype: torch.dtype
    #: ``train.seed``; the default RNG is reseeded per replica with
    #: :func:`dropout_seed` after set-up, so ranks of one replica share masks on
    #: activations they all hold; strategies seed their own generator for
    #: regions whose activations differ across the ranks of a replica (TP heads)
    seed: int = 0
    #: ``parallel.collective_timeout_s``: pass it to ``dist.new_group(timeout=...)``
    #: for sub-groups, so a mismatched collective there also ends in an error
    collective_timeout: timedelta = timedelta(seconds=600)
    comm: CommCounter = field(default_factory=CommCounter)
    extra: dict[str, Any] = field(default_factory=dict)
    #: ``train.precision`` resolved (:mod:`disagg.interfaces.precision`); None: the recipe whose
    #: compute dtype is ``dtype`` (float32 -> ``fp32``, bfloat16 -> ``bf16``)
    recipe: Recipe | None = None
    #: ``parallel.<module>.context_parallel``: ranks of a replica that each hold 1/N of
    #: every sample's tokens (:mod:`disagg.kit.context_parallel`); 1 for no split
    context_parallel: int = 1

    def __post_init__(self) -> None:
        if self.recipe is None:
            self.recipe = RECIPES["fp32" if self.dtype == torch.float32 else "bf16"]
        if self.recipe.weights != self.dtype:
            raise ValueError(f"dtype {self.dtype} is not recipe {self.recipe.name!r}'s {self.recipe.weights}")

    @property
    def replica_size(self) -> int:
        """Ranks of one replica: ``degree * context_parallel``."""
        return self.degree * self.context_parallel

    @property
    def shard(self) -> int:
        """This rank's SP or TP rank (its index among the ranks holding the same tokens)."""
        return self.rank % self.degree

    @property
    def cp_rank(self) -> int:
        """This rank's index among its replica's context-parallel ranks (0 without CP)."""
        return (self.rank // self.degree) % self.context_parallel

    @property
    def replica(self) -> int:
        """Data-parallel replica this rank belongs to."""
        return self.rank // self.replica_size

    def shard_ranks(self, replica: int | None = None, cp_rank: int | None = None) -> list[int]:
        """Global ranks of one SP/TP group: one replica's ranks that hold the same tokens
        (without context parallelism: the whole replica)."""
        r = self.replica if replica is None else replica
        c = self.cp_rank if cp_rank is None else cp_rank
        start = r * self.replica_size + c * self.degree
        return list(range(start, start + self.degree))

    def replica_ranks(self, replica: int | None = None) -> list[int]:
        """Global ranks of one replica (they share samples)."""
        r = self.replica if replica is None else replica
        return list(range(r * self.replica_size, (r + 1) * self.replica_size))

    def cp_peers(self, replica: int | None = None, shard: int | None = None) -> list[int]:
        """Global ranks of one context-parallel group: the ranks of a replica with the same
        SP/TP rank, in sequence-chunk order (just this rank without context parallelism)."""
        r = self.replica if replica is None else replica
        s = self.shard if shard is None else shard
        return [r * self.replica_size + c * self.degree + s for c in range(self.context_parallel)]

    def replica_peers(self, shard: int | None = None, cp_rank: int | None = None) -> list[int]:
        """Global ranks holding the same shard index (and CP rank) in every replica."""
        s = self.shard if shard is None else shard
        c = self.cp_rank if cp_rank is None else cp_rank
        return [r * self.replica_size + c * self.degree + s for r in range(self.replicas)]


def dropout_seed(seed: int, replica: int, shard: int | None = None) -> int:
    """The RNG seed for dropout on ``replica`` (and, for activations sharded
    across the ranks of a replica, on ``shard``); distinct per argument tuple."""
    return (seed * 1_000_003 + replica * 1009 + (0 if shard is None else shard + 1)) % (2**63 - 1)
