"""Handing locally computed gradients to DeepSpeed through a backward whose
graph is the same on every rank.

ZeRO-2/3 reduce gradients inside backward, in hooks that fire as each
parameter's gradient is accumulated; the reduction buckets follow the order
in which they fire. That order, and whether a hook fires at all, depends on
the autograd graph, i.e. on this rank's samples: a rank with no sample fires
none and its peers wait forever, and two ranks with differently shaped samples
can fill their buckets in different orders. So the strategy first computes
this rank's parameter gradients with ``torch.autograd.grad`` (which runs no
accumulation hook), then calls the engine's backward on :func:`injector`: a
scalar whose graph has one edge per trainable parameter, in module order,
carrying exactly the computed gradient (zeros for none) — identical on every
rank whatever its share of the microbatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class _Inject(torch.autograd.Function):
    """A scalar zero whose gradient with respect to each parameter is a given tensor."""

    @staticmethod
    def forward(ctx, grads: list[torch.Tensor], *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.grads = grads
        # The value is never used; it must not read the parameters, whose
        # data ZeRO-3 may hold partitioned.
        return torch.zeros((), dtype=torch.float32, device=grads[0].device)

    @staticmethod
    def backward(ctx, out: torch.Tensor) -> tuple[None, ...]:  # type: ignore[override]
        grads = ctx.grads
        ctx.grads = None
        # ``out`` is 1 (times any loss scale): multiplying by it is exact.
        return (None, *(g * out.to(g.dtype) for g in grads))


def full_shape(p: nn.Parameter) -> torch.Size:
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape  # type: ignore[return-value]


def injector(
    params: Sequence[nn.Parameter], local: Sequence[torch.Tensor | None], scale: float = 1.0
) -> torch.Tensor:
    """Scalar to run the engine's backward on: parameter ``i`` receives
    ``local[i] * scale``, or zeros where ``local[i]`` is None."""
    grads = []
    for p, g in zip(params, local):
        if g is None:
            g = torch.zeros(full_shape(p), dtype=p.dtype, device=p.device)
        elif scale != 1.0:
            g = g * scale
        grads.append(g)
    return _Inject.apply(grads, *params)


def local_grads(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor],
) -> list[torch.Tensor | None]:
    """Gradients of ``outputs`` (seeded with ``grad_outputs``) with respect to
    ``inputs``; ``None`` where an input is not reached, as ``.grad`` would stay."""
    if not outputs or not inputs:
        return [None] * len(inputs)
    return list(torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True))
