"""``ddp``: every rank holds the whole module and its own samples (degree 1)."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from disagg.interfaces import Cost, CostQuery, ReplicatedOptions, Strategy, StrategyOptions


class DDPStrategy(Strategy):
    """Data parallelism: replicas read disjoint samples and gradients are summed
    across them (the loss is already normalised by the global label count,
    so a sum — not a mean — gives the single-process gradient). Everything but
    ``parallelize`` is the base :class:`~disagg.interfaces.Strategy`'s; ``max_degree = 1``
    makes its default ``check`` refuse other degrees."""

    name: ClassVar[str] = "ddp"
    max_degree: ClassVar[int | None] = 1
    recompute_modes: ClassVar[tuple[str, ...]] = ("none", "full")
    options_model: ClassVar[type[StrategyOptions]] = ReplicatedOptions

    def parallelize(self, module: nn.Module) -> nn.Module:
        # Gradient sum happens once per step, after (or, with overlap_grad_reduce, during) the
        # last microbatch's backward, which is what DistributedDataParallel's no_sync would do.
        self.recompute.apply_full(module, f"module {self.ctx.module!r}")
        return module

    @classmethod
    def estimate(cls, query: CostQuery, options: StrategyOptions) -> Cost | None:
        """Every rank a full replica, gradients all-reduced (:mod:`disagg.builtin.ddp_cost`)."""
        from disagg.builtin import ddp_cost

        return ddp_cost.estimate(query, getattr(options, "loss_chunk_tokens", None))
