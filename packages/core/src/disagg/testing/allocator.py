"""The peak of live CPU allocations over a window, as PyTorch's allocator sees it: every
allocation and free that ``torch.profiler.profile(profile_memory=True)`` records, summed in
time order.

The profiler's summaries (``prof.events()``, ``key_averages``) fold the memory records into the
ops that ran them (a record inside an op counts for it and for each parent), so they cannot give
a peak; the raw records can: ``prof.profiler.kineto_results.events()`` (undocumented, pinned in
``packages/core/tests/test_private_names.py`` and checked on a known sequence by
``tests/test_allocator_peak.py``), where a ``[memory]`` record has ``nbytes()`` (negative for a
free) and ``start_ns()``. The window is marked in the record stream itself (an allocation of a
size nothing else uses), so no clock has to be matched.

Not seen: memory a library takes outside PyTorch's allocator (gloo's buffers, Python objects),
as on a GPU NCCL's buffers are outside ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

#: the profiler's name for a memory record (``torch.autograd.profiler.MEMORY_EVENT_NAME``)
MEMORY_EVENT = "[memory]"
#: byte sizes of the marker allocations that open and close the window (primes: no tensor of the
#: tiny model's steps has these sizes)
OPEN, CLOSE = 1_000_003, 1_000_033


@dataclass
class LivePeak:
    """What :func:`trace_live` measured, relative to what was live when the trace began:
    ``baseline`` live when the window opened, ``peak`` the most live inside it."""

    baseline: int = 0
    peak: int = 0
    #: records inside the window (0 would be a broken trace)
    records: int = 0

    @property
    def above_baseline(self) -> int:
        """The window's own peak: what it allocated beyond what it started with."""
        return self.peak - self.baseline


def memory_records(prof: profile) -> list[tuple[int, int]]:
    """``(start_ns, bytes)`` of every CPU memory record of a finished ``prof``, in time order."""
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:
        raise RuntimeError(
            f"torch {torch.__version__}: the profiler's raw results (prof.profiler.kineto_results) "
            "are gone; disagg.testing.allocator needs another source of memory records"
        )
    out = [
        (e.start_ns(), e.nbytes())
        for e in results.events()
        if e.name() == MEMORY_EVENT and str(e.device_type()).endswith("CPU")
    ]
    return sorted(out, key=lambda r: r[0])


def live_peak(records: list[tuple[int, int]]) -> LivePeak:
    """Sum ``records`` in order; the window is what lies between the :data:`OPEN` and
    :data:`CLOSE` markers (each an allocation and its free, left out of the sums)."""
    sizes = [n for _, n in records]
    if sizes.count(OPEN) != 1 or sizes.count(CLOSE) != 1:
        raise RuntimeError(
            f"trace_live: expected one window marker each, saw {sizes.count(OPEN)}/{sizes.count(CLOSE)}"
        )
    out, live, inside = LivePeak(), 0, None
    for n in sizes:
        if abs(n) in (OPEN, CLOSE):
            if n == OPEN:
                inside, out.baseline, out.peak = True, live, live
            elif n == CLOSE:
                break
            continue
        live += n
        if inside:
            out.records += 1
            out.peak = max(out.peak, live)
    return out


def _mark(size: int) -> None:
    torch.empty(size, dtype=torch.uint8)  # allocated and freed at once: one +size, one -size record


@contextmanager
def trace_live() -> Iterator[tuple[LivePeak, Callable[[], AbstractContextManager[None]]]]:
    """``with trace_live() as (peak, window): build(); with window(): step()``; ``peak`` is
    filled when the outer block exits. Allocations made before the trace began are not seen
    (their frees inside it are, as negative records): begin it before the state is built."""
    result = LivePeak()

    @contextmanager
    def window() -> Iterator[None]:
        _mark(OPEN)
        try:
            yield
        finally:
            _mark(CLOSE)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result, window
    got = live_peak(memory_records(prof))
    result.baseline, result.peak, result.records = got.baseline, got.peak, got.records


def trace(build: Callable[[], Any], step: Callable[[Any], None]) -> tuple[Any, LivePeak]:
    """``build()`` then ``step(built)`` in one trace, the window around the step."""
    with trace_live() as (peak, window):
        built = build()
        with window():
            step(built)
    return built, peak
