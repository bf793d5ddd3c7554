"""A rank's device figures per step: GPU time from CUDA events and memory
(allocated and reserved peaks of the process, the GPU's used memory).

Host timers see CUDA work only when it is synchronized, and one process's
allocated peak misses the allocator's cache, the CUDA context, NCCL's buffers
and the other processes that share the GPU under collocated placement.
"""

from __future__ import annotations

import resource
from typing import Any

import torch

from disagg.metrics.record import RankRecord


class DeviceTimer:
    """GPU time of a rank's calls: an event pair around each, read once per
    step (one sync, at the step's end); a no-op on CPU."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.events: list[tuple[Any, Any]] = []

    def start(self) -> Any:
        if not self.enabled:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, start: Any) -> None:
        if start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.events.append((start, end))

    def read(self) -> float:
        """Seconds of GPU time since the last read (waits for the last event)."""
        if not self.events:
            return 0.0
        self.events[-1][1].synchronize()
        total = sum(s.elapsed_time(e) for s, e in self.events) / 1000.0
        self.events.clear()
        return total


def record_memory(rec: RankRecord, device: torch.device) -> None:
    """Fill ``rec``'s memory figures for the step that ends, and start the next
    step's peaks. CPU: the process's max RSS (Linux reports KiB)."""
    if device.type != "cuda":
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        rec.peak_mem_bytes = rec.peak_reserved_bytes = rss
        return
    import ray

    rec.peak_mem_bytes = int(torch.cuda.max_memory_allocated(device))
    rec.peak_reserved_bytes = int(torch.cuda.max_memory_reserved(device))
    free, total = torch.cuda.mem_get_info(device)
    rec.device_used_bytes = int(total - free)
    gpus = ray.get_gpu_ids()  # CUDA_VISIBLE_DEVICES is this actor's: index 0 is Ray's gpus[0]
    node = ray.get_runtime_context().get_node_id()
    rec.device = f"{node[:12]}:{gpus[0] if gpus else device.index}"
    torch.cuda.reset_peak_memory_stats(device)
