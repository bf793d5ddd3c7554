"""Gradients that some rank of a group never received.

The single-process reference leaves a parameter whose gradient is ``None``
alone: AdamW skips it (no momentum, no weight decay, no step count). A group
must do the same, on every rank alike, even when only some ranks (a replica
that got no image, say) lack the gradient: the ranks first agree which
parameters have a gradient *anywhere* in the group; only those take part in
the reduction (zeros stand in on ranks that lack them) and in the update.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from disagg.interfaces.comm import CommCounter


def agree_on_grads(
    params: Sequence[torch.nn.Parameter],
    comm: CommCounter,
    group: dist.ProcessGroup | None = None,
) -> list[bool]:
    """Which of ``params`` got a gradient on some rank of ``group`` (one small
    all-reduce; every rank must pass the same parameters in the same order).

    A parameter present somewhere gets a zero gradient here if it has none,
    so the reduction that follows sums the same tensors on every rank; one
    absent everywhere keeps ``grad = None`` and the optimizer skips it.
    """
    if not params:
        return []
    here = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        comm.all_reduce(here, group=group)
    present = [bool(v) for v in here.tolist()]
    for p, keep in zip(params, present):
        if keep and p.grad is None:
            p.grad = torch.zeros_like(p)
    return present
