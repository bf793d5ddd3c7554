"""Timing one piece of work on the device: warm-up, then the median of a few repeats,
synchronized on CUDA (kernels run asynchronously)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
