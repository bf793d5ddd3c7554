"""The language role under context parallelism: what a rank returns after its slice's
forward and backward.

Each context-parallel rank of a replica gets the replica's samples and, of their encoder
outputs, only the rows scattered at its own tokens (routed by the driver,
:mod:`.routing`); every row's gradient is thus whole on the one rank that holds its token and
goes back from there, summed with nothing. The loss covers only the rank's own label tokens,
so the loss and the evaluation counts are summed over the group, which the driver reads from
one rank per replica.
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
        # on the rank's device: NCCL reduces device tensors only
        total = torch.tensor([loss], dtype=torch.float32, device=self.ctx.device)
        cp.sum_over_ranks([total])
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
