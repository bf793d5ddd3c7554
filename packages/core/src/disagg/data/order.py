"""The deterministic sample order: datasets mixed by weight, epochs reshuffled per seed.

The stream is a pure function of (dataset sizes, weights, seed, shuffle), so
two runs with the same seed see the same samples in the same order and a
resumed run regenerates exactly where it stopped.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np


def sample_stream(
    sizes: Sequence[int], weights: Sequence[float], seed: int, shuffle: bool
) -> Iterator[tuple[int, int]]:
    """Endless ``(dataset, index within dataset)`` pairs.

    Each dataset is walked through a permutation per pass (file order without
    ``shuffle``), reshuffled with a seed derived from (seed, dataset, pass);
    which dataset the next sample comes from is drawn with probability
    proportional to its weight.
    """
    live = [d for d, n in enumerate(sizes) if n > 0]
    if not live:
        raise ValueError("no samples to draw from")
    probs = np.array([weights[d] for d in live], dtype=np.float64)
    probs /= probs.sum()
    cursors = {d: _walk(sizes[d], seed, d, shuffle) for d in live}
    if len(live) == 1:
        only = cursors[live[0]]
        while True:
            yield live[0], next(only)
    picker = np.random.default_rng([seed, 7919])
    while True:
        # draw in blocks: one numpy call per 4096 samples instead of per sample
        for k in picker.choice(len(live), size=4096, p=probs):
            d = live[int(k)]
            yield d, next(cursors[d])


def _walk(n: int, seed: int, dataset: int, shuffle: bool) -> Iterator[int]:
    epoch = 0
    while True:
        if shuffle:
            order = np.random.default_rng([seed, dataset, epoch]).permutation(n)
        else:
            order = np.arange(n)
        yield from (int(i) for i in order)
        epoch += 1


def file_order(sizes: Sequence[int]):
    """``take(start, n)`` for the datasets one after the other in file order (one pass)."""
    bounds = np.cumsum([0, *sizes])

    def take(start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        pos = np.arange(start, start + n)
        ds = np.searchsorted(bounds, pos, side="right") - 1
        return ds, pos - bounds[ds]

    return take


class StreamOrder:
    """Random access into :func:`sample_stream`: ``take(start, n)`` gives stream
    entries ``start .. start+n-1`` without walking the ones before ``start``
    sample by sample, so a resumed run finds its place in O(start / 4096) numpy
    calls and never touches (let alone preprocesses) the skipped samples.

    Entry ``k`` of dataset ``d`` in the stream is the ``k``-th draw of ``d``;
    it lands at ``permutation(seed, d, k // size)[k % size]``. Identical to
    :func:`sample_stream` (tested), which stays as the readable definition.
    """

    BLOCK = 4096

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], seed: int, shuffle: bool) -> None:
        self.sizes = [int(n) for n in sizes]
        self.live = [d for d, n in enumerate(self.sizes) if n > 0]
        if not self.live:
            raise ValueError("no samples to draw from")
        probs = np.array([weights[d] for d in self.live], dtype=np.float64)
        self.probs = probs / probs.sum()
        self.seed, self.shuffle = seed, shuffle
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        # per picker block: the draws of the block and how many of each dataset came before it
        self._blocks: list[np.ndarray] = []
        self._before: list[np.ndarray] = []
        self._picker = np.random.default_rng([seed, 7919])

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        while len(self._blocks) <= b:
            before = np.zeros(len(self.live), dtype=np.int64)
            if self._blocks:
                before = self._before[-1] + np.bincount(self._blocks[-1], minlength=len(self.live))
            self._blocks.append(self._picker.choice(len(self.live), size=self.BLOCK, p=self.probs))
            self._before.append(before)
            if len(self._blocks) > 2:  # only the running counts of old blocks are needed again
                self._blocks[-3] = np.empty(0, dtype=np.int64)
        return self._blocks[b], self._before[b]

    def _perm(self, d: int, epoch: int) -> np.ndarray:
        key = (d, epoch)
        if key not in self._perms:
            if len(self._perms) > 4:  # the stream moves forward: keep a few epochs, not all
                self._perms.pop(next(iter(self._perms)))
            n = self.sizes[d]
            order = np.random.default_rng([self.seed, d, epoch]).permutation(n) if self.shuffle else None
            self._perms[key] = order if order is not None else np.arange(n)
        return self._perms[key]

    def take(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(datasets, indices)`` of stream entries ``start .. start+n-1``."""
        pos = np.arange(start, start + n, dtype=np.int64)
        if len(self.live) == 1:
            ds = np.full(n, self.live[0], dtype=np.int64)
            draws = pos  # the k-th entry is the k-th draw of the only dataset
        else:
            ds = np.empty(n, dtype=np.int64)
            draws = np.empty(n, dtype=np.int64)
            first, last = start // self.BLOCK, (start + n - 1) // self.BLOCK if n else start // self.BLOCK
            # recompute running counts from a fresh picker when asked to go back
            if first < len(self._blocks) and self._blocks[first].size == 0:
                self._blocks, self._before = [], []
                self._picker = np.random.default_rng([self.seed, 7919])
            for b in range(first, last + 1):
                picks, before = self._block(b)
                lo, hi = max(start, b * self.BLOCK), min(start + n, (b + 1) * self.BLOCK)
                if lo >= hi:
                    continue
                sel = picks[: hi - b * self.BLOCK]
                out = slice(lo - start, hi - start)
                chosen = sel[lo - b * self.BLOCK :]
                rank = np.empty_like(chosen)
                for j in range(len(self.live)):
                    mask = sel == j
                    ordinal = before[j] + np.cumsum(mask) - 1  # draws of j up to and including here
                    rank[chosen == j] = ordinal[lo - b * self.BLOCK :][chosen == j]
                ds[out] = np.asarray(self.live)[chosen]
                draws[out] = rank
        idx = np.empty(n, dtype=np.int64)
        for d in np.unique(ds):
            m = ds == d
            size = self.sizes[int(d)]
            epochs, offsets = np.divmod(draws[m], size)
            vals = np.empty(int(m.sum()), dtype=np.int64)
            for e in np.unique(epochs):
                em = epochs == e
                vals[em] = self._perm(int(d), int(e))[offsets[em]]
            idx[m] = vals
        return ds, idx
