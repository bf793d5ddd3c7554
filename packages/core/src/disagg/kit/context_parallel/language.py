"""The language role under context parallelism: what a rank returns after its slice's
forward and backward.

Every context-parallel rank of a replica gets the replica's samples and all their encoder
rows; its loss covers only its own label tokens, so each embedding row's gradient on one rank
is that rank's share. The shares are summed over the group before the replica's first rank
returns them (summed exactly once: the other ranks return none), and so are the loss and the
evaluation counts, which the driver reads from one rank per replica.
"""

from __future__ import annotations

from typing import Any

import torch

from disagg.interfaces.context import GroupContext
from disagg.kit.context_parallel.state import current


class ContextParallelLanguage:
    """Mixin before :class:`~disagg.kit.Strategy` (or a strategy subclassing it)."""

    ctx: GroupContext

    def loss_and_backward(
        self,
        mb: int,
        inputs: list[dict[str, torch.Tensor]],
        embeds: list[dict[str, torch.Tensor]],
        loss_scale: float,
    ) -> float:
        loss = super().loss_and_backward(mb, inputs, embeds, loss_scale)  # type: ignore[misc]
        cp = current()
        if cp is None:
            return loss
        leaves = [t for e in embeds for t in e.values() if t.requires_grad]
        for t in leaves:
            if t.grad is None:  # no token of it on this rank: its share is zero
                t.grad = torch.zeros_like(t)
        # on the rank's device: NCCL reduces device tensors only
        total = torch.tensor([loss], dtype=torch.float32, device=self.ctx.device)
        cp.sum_over_ranks([t.grad for t in leaves] + [total])  # type: ignore[misc]
        return float(total)

    def evaluate(
        self, inputs: list[dict[str, torch.Tensor]], embeds: list[dict[str, torch.Tensor]]
    ) -> tuple[float, int, int]:
        res: Any = super().evaluate(inputs, embeds)  # type: ignore[misc]
        cp = current()
        if cp is None:
            return res
        sums = torch.tensor([float(x) for x in res], dtype=torch.float64, device=self.ctx.device)
        cp.sum_over_ranks([sums])
        return float(sums[0]), int(round(float(sums[1]))), int(round(float(sums[2])))
