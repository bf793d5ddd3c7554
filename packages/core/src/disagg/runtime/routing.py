"""Per-sample routing: which replica of which group sees which sample.

Routing is per sample so groups may differ in degree and replicas: the vision
group can split a microbatch over 2 replicas while the LLM group splits it over
3; the driver wires each shard's ObjectRef to whichever LLM rank owns the
sample. Replicas get contiguous, disjoint, balanced slices.
"""

from __future__ import annotations


def split_microbatches(n: int, microbatches: int) -> list[range]:
    """Positions of a global batch of ``n`` samples in each microbatch."""
    return balanced(n, microbatches)


def assign(n: int, replicas: int) -> list[list[int]]:
    """Sample positions (0..n-1) each replica processes: disjoint, covering, balanced."""
    return [list(r) for r in balanced(n, replicas)]


def balanced(n: int, parts: int) -> list[range]:
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out
