"""The device buffer of the base class's gradient reduction (:func:`disagg.kit.grads.all_reduce_bucketed`),
the ``buffers`` term (:attr:`disagg.interfaces.cost.Cost.buffer_bytes`) of every strategy that
reduces with it (``ddp``, ``ulysses``)."""

from __future__ import annotations

from disagg.kit.grads.buckets import bucket_sizes
from disagg.kit.sharding.modes import FSDP_MODES

__all__ = ["grad_bucket_bytes"]


def grad_bucket_bytes(
    numels: list[int], grad_bytes: int, world: int, shard: str, offload: bool, overlap: bool = False
) -> int:
    """Device bytes of the flat buffers the group's gradient all-reduce allocates
    (:func:`disagg.kit.grads.all_reduce_bucketed`): a bucket of several gradients (at most
    ``BUCKET_BYTES``, 25 MiB, or all of them if fewer) is concatenated into one tensor, one bucket
    at a time; a bucket of one contiguous gradient is reduced in place. ``overlap``
    (``overlap_grad_reduce``, :class:`disagg.kit.grads.overlap.OverlappedReducer`): every
    bucket's buffer is held until the reduction ends, a copy of all the gradients. None on one
    rank, under FSDP2 (``shard: gradients | parameters`` reduce-scatter in backward) or
    ``offload: optimizer`` (the reduction runs on the host masters' gradient sums). Counted as
    held beside the activations: whether it is live at their peak is timing
    (``tests/test_allocator_peak.py`` measured ``ddp``'s llm peak at 0.85 and 1.22 of the
    prediction without it, the two peaks apart by exactly the gradients' bytes)."""
    if world == 1 or shard in FSDP_MODES or offload:
        return 0
    buckets = bucket_sizes(numels, grad_bytes)
    sizes = [sum(numels[i] for i in b) * grad_bytes for b in buckets]
    if overlap:
        return sum(sizes)
    return max((n for n, b in zip(sizes, buckets) if len(b) > 1), default=0)
