"""One rank's context-parallel state: its group, its place in it, and the sequence the
current microbatch was split from.

A rank holds one module, so the state is the process's (:func:`install`, :func:`current`);
the attention function and the family's forward read it. The sequence (:meth:`ContextParallel.
begin`) stays set until the next forward, so a block recomputed in backward
(``recompute: full``) gathers and masks exactly as its forward did.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from disagg.interfaces.comm import CommCounter
from disagg.interfaces.context import GroupContext
from disagg.kit.context_parallel.split import gathered_order, local_positions, padded_length


@dataclass
class ContextParallel:
    """``size`` ranks (``group``) splitting each sample's sequence; this one is ``rank``."""

    group: dist.ProcessGroup
    size: int
    rank: int
    comm: CommCounter
    #: the rank's device (NCCL reduces device tensors only)
    device: torch.device = torch.device("cpu")
    #: global positions of this rank's tokens in the current padded sequence
    positions: torch.Tensor | None = None
    #: rows of the all-gathered keys/values in global order (see :func:`gathered_order`)
    order: torch.Tensor | None = None
    #: padded length of the current sequence
    length: int = 0
    _cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def padded_length(self, tokens: int) -> int:
        return padded_length(tokens, self.size)

    def begin(self, length: int, device: torch.device) -> torch.Tensor:
        """A forward over a padded sequence of ``length`` tokens starts: set and return this
        rank's token positions."""
        key = (length, str(device))
        if key not in self._cache:
            self._cache[key] = (
                local_positions(length, self.size, self.rank, device),
                gathered_order(length, self.size, device),
            )
        self.positions, self.order = self._cache[key]
        self.length = length
        return self.positions

    def sum_figures(self, figures: list[float]) -> list[float]:
        """The language role's hook (``LanguageRole.replica_sum``): a rank's loss and evaluation
        counts, of its own tokens, summed over the group into its replica's (fp64, one call)."""
        t = torch.tensor(figures, dtype=torch.float64, device=self.device)
        self.sum_over_ranks([t])
        return [float(x) for x in t]

    def sum_over_ranks(self, tensors: list[torch.Tensor]) -> None:
        """Sum ``tensors`` in place over the group, in one flat buffer (one call)."""
        if not tensors:
            return
        # fp32 at least (bf16 shares and the loss are summed in fp32); fp64 kept (counts)
        wide = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
        flat = torch.cat([t.reshape(-1).to(wide) for t in tensors])
        self.comm.all_reduce(flat, self.group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


_ACTIVE: ContextParallel | None = None


def install(ctx: GroupContext) -> ContextParallel | None:
    """Make this rank's context-parallel groups (collective: every rank of the module's group
    calls it, also when ``ctx.context_parallel`` is 1, then it makes none and returns None)."""
    global _ACTIVE
    n = ctx.context_parallel
    if n == 1:
        _ACTIVE = None
        return None
    mine = None
    for r in range(ctx.replicas):  # every rank creates every group, in the same order
        for s in range(ctx.degree):
            ranks = ctx.cp_peers(r, s)
            g = dist.new_group(ranks, timeout=ctx.collective_timeout)
            if ctx.rank in ranks:
                mine = g
    assert mine is not None
    _ACTIVE = ContextParallel(mine, n, ctx.cp_rank, ctx.comm, ctx.device)
    return _ACTIVE


def current() -> ContextParallel | None:
    """This process's context-parallel state, None without context parallelism."""
    return _ACTIVE
