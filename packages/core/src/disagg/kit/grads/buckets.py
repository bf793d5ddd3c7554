"""How gradients are grouped into all-reduce buckets: shared by the strategies
that reduce them (:func:`disagg.kit.all_reduce_bucketed`) and the cost
model that counts their calls and bytes, so the two cannot drift apart."""

from __future__ import annotations

from collections.abc import Sequence

#: bytes per gradient all-reduce bucket: torch DDP's default ``bucket_cap_mb=25``
BUCKET_BYTES = 25 * 1024 * 1024


def bucket_sizes(numels: Sequence[int], element_size: int, cap_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of ``numels`` in buckets as :func:`all_reduce_bucketed` forms them
    (in order, a new bucket when the next tensor would pass ``cap_bytes``; a
    tensor larger than the cap is a bucket of its own). The cost model counts
    calls and bytes with the same function."""
    out: list[list[int]] = []
    size = 0
    for i, n in enumerate(numels):
        nbytes = n * element_size
        if not out or (size + nbytes > cap_bytes and size > 0):
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out
