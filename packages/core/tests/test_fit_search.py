"""The budget searches' one search (``disagg.bench.fit_search``) at its edges: a limit at the
cap, past it, nothing fitting, every exact boundary; each length probed at most once."""

from __future__ import annotations

import pytest

from disagg.bench.fit_search import longest_fitting


def probed(limit: int, cap: int) -> tuple[int, list[int]]:
    """The search's answer for "fits up to ``limit``", and the lengths it asked about."""
    asked: list[int] = []

    def fits(k: int) -> bool:
        asked.append(k)
        return k <= limit

    return longest_fitting(fits, cap), asked


@pytest.mark.parametrize("cap", [1, 2, 3, 7, 8, 1000, 1024])
def test_fits_at_and_past_the_cap_returns_the_cap(cap):
    for limit in (cap, cap + 1, 10 * cap):
        got, asked = probed(limit, cap)
        assert got == cap and max(asked) == cap  # never probes past the cap
        assert len(asked) == len(set(asked))


@pytest.mark.parametrize("cap", [0, 1, 8, 1000])
def test_fits_nothing_returns_0(cap):
    got, asked = probed(0, cap)
    assert got == 0 and asked == ([1] if cap >= 1 else [])


@pytest.mark.parametrize("cap", [2, 3, 8, 100, 1000, 1024])
def test_every_boundary_below_the_cap_is_exact(cap):
    for limit in range(1, cap):
        got, asked = probed(limit, cap)
        assert got == limit, (limit, cap)
        assert len(asked) == len(set(asked)) and max(asked) <= cap
        assert len(asked) <= 2 * cap.bit_length() + 1  # doubling, then bisection
