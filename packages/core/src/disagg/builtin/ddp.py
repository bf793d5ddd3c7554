"""``ddp``: every rank holds the whole module and its own samples (degree 1), or, with
``parallel.<module>.shard``, its share of the module's state (:mod:`disagg.kit.sharding`)."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from disagg.interfaces import Cost, CostQuery, Family, ReplicatedOptions, StrategyOptions
from disagg.kit import Strategy, context_parallel
from disagg.kit.offload import offloaded
from disagg.kit.recompute import tiled_mlp
from disagg.kit.sharding import shard_problems


class DDPStrategy(Strategy):
    """Data parallelism: replicas read disjoint samples and gradients are summed
    across them (the loss is already normalised by the global label count,
    so a sum — not a mean — gives the single-process gradient). Everything but
    ``parallelize`` is the base :class:`~disagg.kit.Strategy`'s, the sharded state
    (``parallel.<module>.shard``) and its lockstep included; ``max_degree = 1`` makes its
    default ``check`` refuse other degrees.

    With ``parallel.llm.context_parallel: N`` a replica is N ranks, each with 1/N of every
    sample's tokens (:mod:`disagg.kit.context_parallel`): to the gradient sum and to a sharded
    state they are more data-parallel ranks (each holds partial gradients of every weight)."""

    name: ClassVar[str] = "ddp"
    max_degree: ClassVar[int | None] = 1
    recompute_modes: ClassVar[tuple[str, ...]] = ("none", "full")
    precisions: ClassVar[tuple[str, ...]] = ("fp32", "bf16", "bf16-pure")
    options_model: ClassVar[type[StrategyOptions]] = ReplicatedOptions
    context_parallel_support: ClassVar[bool] = True
    #: every rank's MLPs run on its own rows: tiles of them are the same rows
    mlp_tiles_support: ClassVar[bool] = True

    @classmethod
    def check(cls, family: Family, degree: int, replicas: int, options: StrategyOptions) -> list[str]:
        return super().check(family, degree, replicas, options) + shard_problems(family, options)

    def parallelize(self, module: nn.Module) -> nn.Module:
        # Gradient sum happens once per step, after (or, with overlap_grad_reduce, during) the
        # last microbatch's backward, which is what DistributedDataParallel's no_sync would do.
        # torchtitan's order: context parallelism -> recompute -> the MLPs in row tiles (inside
        # the blocks) -> sharding.
        context_parallel.apply(module, self.ctx, self)
        self.recompute.apply_full(module, f"module {self.ctx.module!r}")
        if tiled_mlp.enabled(self.options.mlp_tiles):  # a family-less module (tests, plugins) never tiles
            tiled_mlp.apply(module, self.family.layer_map(), self.options.mlp_tiles, self.recompute.tile)
        return self.shard_state(module)

    @classmethod
    def estimate(cls, query: CostQuery, options: StrategyOptions) -> Cost | None:
        """Every rank a full replica, gradients all-reduced (:mod:`disagg.builtin.ddp_cost`)."""
        from disagg.builtin import ddp_cost

        return ddp_cost.estimate(
            query,
            getattr(options, "loss_chunk_tokens", None),
            getattr(options, "shard", "none"),
            offloaded(options),
            getattr(options, "overlap_grad_reduce", False),
            getattr(options, "mlp_tiles", 1),
        )

    @classmethod
    def option_variants(cls) -> list[dict[str, Any]]:
        """``disagg plan`` tries the whole replica and each sharded state, each also with the
        optimizer in host memory (offered on GPU clusters only)."""
        states = [{}, {"shard": "optimizer"}, {"shard": "gradients"}, {"shard": "parameters"}]
        return states + [{**v, "offload": "optimizer"} for v in states]
