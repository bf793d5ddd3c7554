"""One record per rank per step, and the one place they are reduced per group.

Workers fill a :class:`RankRecord` as they run; the driver reduces a group's
records with :func:`reduce_group` into the per-group figures of
``metrics.jsonl``. Nothing here knows about Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RankRecord:
    module: str
    rank: int
    #: seconds inside calls, waits on other groups excluded
    busy_s: float = 0.0
    #: seconds blocked on objects another group had not produced yet
    wait_s: float = 0.0
    #: activations and gradients this rank sent to other groups
    sent_bytes: int = 0
    #: bytes this rank sent in its group's collectives, by kind
    collective_bytes: dict[str, int] = field(default_factory=dict)
    #: collective calls this rank made in its group, by kind
    collective_calls: dict[str, int] = field(default_factory=dict)
    #: of its gradient all-reduces, those sent while its last backward still ran
    #: (``parallel.<module>.overlap_grad_reduce``)
    overlapped_calls: int = 0
    #: peak bytes autograd held saved for backward at once (all microbatches in flight)
    activation_bytes: int = 0
    #: parameters + gradients + optimizer state held by this rank
    state_bytes: int = 0
    #: the process's peak memory: CUDA the caching allocator's allocated peak, CPU max RSS
    peak_mem_bytes: int = 0
    #: CUDA: the allocator's reserved peak (cached blocks included); CPU: as peak_mem_bytes
    peak_reserved_bytes: int = 0
    #: CUDA: the whole GPU's used memory at the step's end (every process on it, CUDA
    #: contexts and NCCL buffers included); 0 on CPU
    device_used_bytes: int = 0
    #: CUDA: "node:gpu" of the GPU this rank ran on (ranks of collocated groups share one)
    device: str = ""
    #: CUDA: seconds the GPU spent on this rank's calls (CUDA events; host time is busy_s)
    device_s: float = 0.0
    lr: float = 0.0


def reduce_group(records: list[RankRecord]) -> dict[str, Any]:
    """A group's figures: per-rank maxima (the slowest or fullest rank bounds
    the group), totals where the sum is what is meant."""
    per_rank_comm = [sum(r.collective_bytes.values()) + r.sent_bytes for r in records]
    return {
        "peak_mem_bytes": max(r.peak_mem_bytes for r in records),
        "peak_reserved_bytes": max(r.peak_reserved_bytes for r in records),
        "device_s": max(r.device_s for r in records),
        "comm_bytes": sum(per_rank_comm),
        "comm_bytes_per_rank": max(per_rank_comm),
        "collective_bytes_per_rank": _max_by_kind([r.collective_bytes for r in records]),
        "collective_calls_per_rank": _max_by_kind([r.collective_calls for r in records]),
        "overlapped_calls_per_rank": max(r.overlapped_calls for r in records),
        "sent_bytes_per_rank": max(r.sent_bytes for r in records),
        "busy_s": max(r.busy_s for r in records),
        "wait_s": max(r.wait_s for r in records),
        "activation_bytes_per_rank": max(r.activation_bytes for r in records),
        "state_bytes_per_rank": max(r.state_bytes for r in records),
        "lr": records[0].lr,
    }


def per_gpu(records: dict[str, list[RankRecord]]) -> dict[str, dict[str, int]]:
    """Per GPU ("node:gpu"), over the ranks of every group on it: the sum of their
    reserved peaks (what the processes held at most, at once at worst) and the
    GPU's used memory (contexts and NCCL buffers included). Empty on CPU."""
    out: dict[str, dict[str, int]] = {}
    for rs in records.values():
        for r in rs:
            if not r.device:
                continue
            g = out.setdefault(r.device, {"peak_reserved_bytes": 0, "used_bytes": 0})
            g["peak_reserved_bytes"] += r.peak_reserved_bytes
            g["used_bytes"] = max(g["used_bytes"], r.device_used_bytes)
    return out


def _max_by_kind(per_rank: list[dict[str, int]]) -> dict[str, int]:
    """Per collective kind, the most any rank counted (a rank without it counts 0)."""
    kinds = sorted({k for counts in per_rank for k in counts})
    return {k: max(counts.get(k, 0) for counts in per_rank) for k in kinds}


@dataclass
class StepResult:
    """What one optimizer step reports to the driver's loop."""

    loss: float
    grad_norm: float
    label_tokens: int
    tokens: int
    step_time_s: float
    #: per module, :func:`reduce_group` of its ranks' records
    groups: dict[str, dict[str, Any]]
    #: every rank's record, by module
    records: dict[str, list[RankRecord]] = field(default_factory=dict)
    #: tokens each module processed: an encoder's placeholder tokens, the LLM's sequences
    module_tokens: dict[str, int] = field(default_factory=dict)
