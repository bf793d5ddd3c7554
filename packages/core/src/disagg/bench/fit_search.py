"""The longest length that fits a budget, for a predicate that holds up to a limit and fails past it.

Both budget searches ask it (the published-setting table, :func:`disagg.bench.published_fit.longest_fit`,
and the sweep's analytic guess, :meth:`disagg.bench.sweep.Bench.predicted_limit`); each probe is
a cost prediction, so the search doubles to bracket the limit and then bisects: about
2 log2(limit) probes instead of one per step.
"""

from __future__ import annotations

from collections.abc import Callable


def longest_fitting(fits: Callable[[int], bool], cap: int) -> int:
    """The largest ``k`` in ``1..cap`` with ``fits(k)``, or 0 when ``fits(1)`` is false (or
    ``cap < 1``). ``fits`` must be monotone: true up to some ``k``, false from there on.

    At the cap: the doubling never probes past ``cap`` (it probes ``cap`` itself once the next
    doubling would reach it), and a predicate that still holds at ``cap`` returns exactly
    ``cap``. Nothing is known past it, so a caller that gets ``cap`` back should say the
    answer is capped, not that ``cap + 1`` is over the budget. Each ``k`` is probed at most once.
    """
    if cap < 1 or not fits(1):
        return 0
    lo, hi = 1, 2  # fits(lo); hi not probed yet
    while hi < cap and fits(hi):
        lo, hi = hi, hi * 2
    if hi >= cap:
        if lo >= cap or fits(cap):
            return cap
        hi = cap
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
