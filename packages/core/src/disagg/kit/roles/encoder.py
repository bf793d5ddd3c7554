"""The encoder role: forward this rank's shard of each sample of a microbatch,
keep what backward needs, and run backward when the LLM's gradients of those
shards come back."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from disagg.interfaces.context import GroupContext
from disagg.interfaces.family import EncoderFamily, Family
from disagg.interfaces.shard import EmbeddingShard
from disagg.kit.lockstep import Lockstep, agreed_max


class EncoderRole:
    """Defaults for a module every rank of a replica runs whole (each rank
    returns whole outputs); the hooks are :class:`~.parallelizer.Parallelizer`'s.
    Under a FSDP2-sharded state every rank runs as many forwards as the busiest
    (:mod:`disagg.kit.lockstep`: placeholders with a zero gradient)."""

    # what this role uses of the strategy it is part of (its Parallelizer's hooks)
    ctx: GroupContext
    family: Family
    module: nn.Module | None
    #: this rank's placeholder calls (:mod:`disagg.kit.lockstep`)
    lockstep: Lockstep
    fsdp: bool
    if TYPE_CHECKING:

        def sharded_call(self, fn: Any, *args: Any) -> Any: ...

        def module_call(self) -> AbstractContextManager[None]: ...

        def backprop(
            self, tensors: list[torch.Tensor], grads: list[torch.Tensor] | None, leaves: list[torch.Tensor]
        ) -> None: ...

    def encode(self, mb: int, inputs: list[dict[str, torch.Tensor]]) -> list[EmbeddingShard]:
        """Forward this rank's share of each sample of microbatch ``mb`` (one
        shard per sample, possibly empty); the graph is kept until
        :meth:`backward` for the same ``mb``. Several microbatches may be in
        flight, and their backwards may come in any order."""
        assert isinstance(self.family, EncoderFamily) and self.module is not None
        if self.fsdp:
            # FSDP2 gathers per forward, so every rank runs as many as the busiest
            n = agreed_max(len(inputs), self.ctx.device, self.ctx.comm)
            outs = [self.sharded_call(self.family.encode, x) for x in self.lockstep.pad(inputs, n)]
            self.lockstep.keep(mb, outs[len(inputs) :])
            return [EmbeddingShard.whole(o) for o in outs[: len(inputs)]]
        with self.module_call():
            return [EmbeddingShard.whole(self.family.encode(self.module, x)) for x in inputs]

    def backward(self, mb: int, outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Backward of microbatch ``mb`` from gradients of this rank's shard
        values; called on every rank that encoded, with or without gradients."""
        pairs = [(o, g.to(o.dtype)) for o, g in zip(outputs, grads) if o.requires_grad and o.numel()]
        # placeholder forwards' backward adds exact zeros, and issues the group's collectives
        pairs += self.lockstep.zero_seeds(mb)
        with self.module_call():
            self.backprop([o for o, _ in pairs], [g for _, g in pairs], [])

    def release(self, mb: int) -> None:
        """Forget what :meth:`encode` kept for ``mb`` when no backward will
        come (evaluation, a frozen module); strategies that keep more per-microbatch
        state extend it."""
        self.lockstep.release(mb)
