"""Which replica gets which sample of a global batch, so that replicas finish together.

A replica's step time grows with its tokens (vision patches for an encoder
group, total tokens for the LLM), and the group waits for its slowest
replica: contiguous slices of a batch that mixes small and large images can
give one replica most of the patches. :func:`balance` assigns positions so
that the largest replica cost is as small as it can cheaply be made. Where a
sample runs never changes its gradient, so this is free for the math.
"""

from __future__ import annotations

from typing import Any, Sequence


def balance(costs: Sequence[int], parts: int) -> list[list[int]]:
    """Positions ``0..len(costs)-1`` split into ``parts`` lists with near-equal cost sums.

    Longest-processing-time greedy (largest cost first onto the lightest part;
    ties by position and part index, so the result is deterministic), then
    single moves and pairwise swaps between the heaviest and the lightest part
    while they lower the heaviest. Each part lists its positions in increasing
    order; a part may be empty when there are fewer samples than parts.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if any(c < 0 for c in costs):
        raise ValueError("costs must be >= 0")
    out: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for p in sorted(range(len(costs)), key=lambda p: (-costs[p], p)):
        k = min(range(parts), key=lambda k: (load[k], len(out[k]), k))
        out[k].append(p)
        load[k] += costs[p]
    for _ in range(4 * len(costs)):  # each round strictly lowers the max pair; bounded anyway
        hi = max(range(parts), key=lambda k: (load[k], -k))
        lo = min(range(parts), key=lambda k: (load[k], k))
        if not _improve(out, load, costs, hi, lo):
            break
    return [sorted(part) for part in out]


def _improve(out: list[list[int]], load: list[int], costs: Sequence[int], hi: int, lo: int) -> bool:
    """One move or swap from ``hi`` to ``lo`` that lowers ``max(load[hi], load[lo])`` most."""
    gap = load[hi] - load[lo]
    best, choice = 0, None
    for a in out[hi]:
        # moving a (or swapping it for b) shifts d = costs[a] - costs[b]; it helps when 0 < d < gap
        for b in [None, *out[lo]]:
            d = costs[a] - (costs[b] if b is not None else 0)
            gain = min(d, gap - d)
            if gain > best:
                best, choice = gain, (a, b)
    if choice is None:
        return False
    a, b = choice
    out[hi].remove(a)
    out[lo].append(a)
    load[hi] -= costs[a]
    load[lo] += costs[a]
    if b is not None:
        out[lo].remove(b)
        out[hi].append(b)
        load[lo] -= costs[b]
        load[hi] += costs[b]
    return True


def contiguous(n: int, parts: int) -> list[list[int]]:
    """Today's split: consecutive slices, the first ``n % parts`` one longer."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        size = base + (k < extra)
        out.append(list(range(start, start + size)))
        start += size
    return out


def sample_costs(samples: Sequence[Any], module: str) -> list[int]:
    """What a sample costs a replica of ``module``: its placeholder tokens for an
    encoder (0 without that media), its total tokens for the ``llm``."""
    if module == "llm":
        return [int(s.num_tokens) for s in samples]
    return [int(s.num_media_tokens.get(module, 0)) for s in samples]


def spread(costs: Sequence[int], assignment: list[list[int]]) -> tuple[int, float]:
    """``(max, mean)`` of the parts' cost sums."""
    sums = [sum(costs[p] for p in part) for part in assignment]
    return max(sums), sum(sums) / len(sums)
