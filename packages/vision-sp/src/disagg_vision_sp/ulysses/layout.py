"""How ``ulysses`` cuts a family's compute-order sequence into shards.

The hook points a family exposes (``SeqLayout``, ``UlyssesFamily``) are defined
in core and imported from :mod:`disagg.interfaces` (one import path), so that
families of other plugins (audio) implement them without depending on this package.
"""

from __future__ import annotations

import bisect


def plan_bounds(cuts: list[int], n_tokens: int, degree: int) -> list[int]:
    """``degree + 1`` shard boundaries taken from ``cuts``, each as close as
    possible to an even split (ties go left). Empty shards are allowed."""
    bounds = [0]
    for k in range(1, degree):
        target = k * n_tokens / degree
        i = bisect.bisect_left(cuts, target)
        options = [c for c in cuts[max(i - 1, 0) : i + 1] if c >= bounds[-1]]
        best = min(options, key=lambda c: (abs(c - target), c)) if options else bounds[-1]
        bounds.append(best)
    bounds.append(n_tokens)
    return bounds
