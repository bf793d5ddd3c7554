"""``ddp``: every rank holds the whole module and its own samples (degree 1), or, with
``parallel.<module>.shard``, its share of the module's state (:mod:`disagg.kit.sharding`)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from disagg.interfaces import Cost, CostQuery, EmbeddingShard, Family, ReplicatedOptions, StrategyOptions
from disagg.kit import Strategy
from disagg.kit.sharding import ShardedReplicas, placeholder_input, shard_problems


class DDPStrategy(ShardedReplicas, Strategy):
    """Data parallelism: replicas read disjoint samples and gradients are summed
    across them (the loss is already normalised by the global label count,
    so a sum — not a mean — gives the single-process gradient). Everything but
    ``parallelize`` (and, under a sharded state, the encoder's forward) is the base
    :class:`~disagg.kit.Strategy`'s; ``max_degree = 1`` makes its default ``check``
    refuse other degrees."""

    name: ClassVar[str] = "ddp"
    max_degree: ClassVar[int | None] = 1
    recompute_modes: ClassVar[tuple[str, ...]] = ("none", "full")
    precisions: ClassVar[tuple[str, ...]] = ("fp32", "bf16", "bf16-pure")
    options_model: ClassVar[type[StrategyOptions]] = ReplicatedOptions

    @classmethod
    def check(cls, family: Family, degree: int, replicas: int, options: StrategyOptions) -> list[str]:
        return super().check(family, degree, replicas, options) + shard_problems(family, options)

    def __init__(self, ctx: Any, family: Family, options: StrategyOptions) -> None:
        super().__init__(ctx, family, options)
        #: microbatch -> outputs of the placeholder forwards this rank ran to match the group's
        self._fill: dict[int, list[torch.Tensor]] = {}
        self._placeholder: dict[str, torch.Tensor] | None = None

    def parallelize(self, module: nn.Module) -> nn.Module:
        # Gradient sum happens once per step, after (or, with overlap_grad_reduce, during) the
        # last microbatch's backward, which is what DistributedDataParallel's no_sync would do.
        self.recompute.apply_full(module, f"module {self.ctx.module!r}")
        return self.shard_state(module)

    # -- encoder role under FSDP2: every rank runs as many forwards as the busiest ----------------------
    def encode(self, mb: int, inputs: list[dict[str, torch.Tensor]]) -> list[EmbeddingShard]:
        if not self.fsdp:
            return super().encode(mb, inputs)
        assert self.module is not None
        n = self.max_count(len(inputs))
        if n > len(inputs) and self._placeholder is None:
            self._placeholder = placeholder_input(self.family, self.ctx.dtype)
        items = list(inputs) + [self._placeholder] * (n - len(inputs))  # type: ignore[list-item]
        outs = [self.sharded_call(self.family.encode, x) for x in items]  # type: ignore[attr-defined]
        if torch.is_grad_enabled():
            self._fill[mb] = outs[len(inputs) :]
        return [EmbeddingShard.whole(o) for o in outs[: len(inputs)]]

    def backward(self, mb: int, outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        if not self.fsdp:
            return super().backward(mb, outputs, grads)
        pairs = [(o, g.to(o.dtype)) for o, g in zip(outputs, grads) if o.requires_grad and o.numel()]
        # the placeholder forwards' backward adds exact zeros, and issues the group's collectives
        pairs += [(o, torch.zeros_like(o)) for o in self._fill.pop(mb, [])]
        self.backprop([o for o, _ in pairs], [g for _, g in pairs], [])

    def release(self, mb: int) -> None:
        self._fill.pop(mb, None)

    @classmethod
    def estimate(cls, query: CostQuery, options: StrategyOptions) -> Cost | None:
        """Every rank a full replica, gradients all-reduced (:mod:`disagg.builtin.ddp_cost`)."""
        from disagg.builtin import ddp_cost

        return ddp_cost.estimate(
            query,
            getattr(options, "loss_chunk_tokens", None),
            getattr(options, "shard", "none"),
            getattr(options, "offload", "none") == "optimizer",
        )

    @classmethod
    def option_variants(cls) -> list[dict[str, Any]]:
        """``disagg plan`` tries the whole replica and each sharded state."""
        return [{}, {"shard": "optimizer"}, {"shard": "gradients"}, {"shard": "parameters"}]
