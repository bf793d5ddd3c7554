"""A rank's host memory around its set-up: the resident high-water mark (VmHWM) of
its process, reset first where the kernel allows (``/proc/self/clear_refs``), so
that what the set-up built and read is told apart from what imports left."""

from __future__ import annotations

import resource
from pathlib import Path


def _status(field: str) -> int:
    """A ``/proc/self/status`` size in bytes (0 where there is no procfs)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def start() -> dict[str, int]:
    """Reset the high-water mark if allowed; the resident bytes now."""
    reset = True
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        reset = False  # the peak then includes what ran before the set-up
    return {"rss_before": _status("VmRSS"), "hwm_reset": int(reset)}


def finish(before: dict[str, int]) -> dict[str, int]:
    """``before`` plus the peak resident bytes since (``hwm``; ``ru_maxrss`` never resets)
    and the peak's rise over the start (``setup_peak``)."""
    hwm = _status("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {**before, "hwm": hwm, "setup_peak": hwm - before["rss_before"], "rss_after": _status("VmRSS")}
