"""The deterministic sample order: datasets mixed by weight, epochs reshuffled per seed.

The stream is a pure function of (dataset sizes, weights, seed, shuffle), so
two runs with the same seed see the same samples in the same order and a
resumed run regenerates exactly where it stopped.
"""

from __future__ import annotations

from itertools import islice
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


def batch_positions(
    sizes: Sequence[int],
    weights: Sequence[float],
    seed: int,
    shuffle: bool,
    batch_size: int,
    start_step: int = 0,
) -> Iterator[list[tuple[int, int]]]:
    """Global batches of ``batch_size`` stream entries, from step ``start_step`` on."""
    stream = sample_stream(sizes, weights, seed, shuffle)
    # regenerating the skipped prefix is cheap (integers only) and keeps resume exact
    for _ in islice(stream, start_step * batch_size):
        pass
    while True:
        yield list(islice(stream, batch_size))
