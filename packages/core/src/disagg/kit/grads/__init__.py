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
from disagg.kit.grads.buckets import BUCKET_BYTES, bucket_sizes


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


def all_reduce_bucketed(
    tensors: Sequence[torch.Tensor],
    comm: CommCounter,
    group: dist.ProcessGroup | None = None,
    cap_bytes: int = BUCKET_BYTES,
) -> None:
    """Sum ``tensors`` over ``group`` in place, in flat buckets of at most
    ``cap_bytes`` (one call per bucket instead of one per tensor, as torch DDP
    buckets its gradients); tensors of different device or dtype never share a
    bucket. Elementwise the same sums as one all-reduce per tensor."""
    kinds: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        kinds.setdefault((t.device, t.dtype), []).append(t)
    for (_, dtype), ts in kinds.items():
        elem = torch.empty((), dtype=dtype).element_size()
        for idx in bucket_sizes([t.numel() for t in ts], elem, cap_bytes):
            part = [ts[i] for i in idx]
            if len(part) == 1 and part[0].is_contiguous():
                comm.all_reduce(part[0], group=group)
                continue
            flat = torch.cat([t.reshape(-1) for t in part])
            comm.all_reduce(flat, group=group)
            offset = 0
            for t in part:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def sum_of_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``Σ x²`` over every element of ``tensors`` as a float64 scalar on their
    device: one fused (foreach) norm per device, no host sync (the caller
    syncs once), no fp64 copy of any tensor."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t.detach())
    if not by_device:
        return torch.zeros((), dtype=torch.float64)
    totals = [
        torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float64)).square().sum()
        for ts in by_device.values()
    ]
    first = totals[0].device
    return torch.stack([t.to(first) for t in totals]).sum()
