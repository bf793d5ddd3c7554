"""One record per rank per step, and the one place they are reduced per group.

Workers fill a :class:`RankRecord` as they run; the driver reduces a group's
records with :func:`reduce_group` into the per-group figures of
``metrics.jsonl``. Nothing here knows about Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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
    #: encoder forward calls this rank ran with at least one sample
    encode_calls: int = 0
    #: of ``busy_s``, the seconds in encoder calls (encode, shards out, cache out)
    encode_s: float = 0.0

    @property
    def comm_bytes(self) -> int:
        """Everything this rank sent: its collectives' bytes and its bytes to other groups."""
        return sum(self.collective_bytes.values()) + self.sent_bytes


def reduce_group(records: list[RankRecord]) -> dict[str, Any]:
    """A group's figures, one per reduced field of :data:`disagg.metrics.fields.FIELDS`: per-rank
    maxima where the slowest or fullest rank bounds the group, totals where the sum is meant."""
    from disagg.metrics.fields import REDUCED

    return {f.name: _REDUCE[f.reduce](getattr(r, f.attribute) for r in records) for f in REDUCED}  # type: ignore[index]


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


def _max_by_kind(values: Iterable[dict[str, int]]) -> dict[str, int]:
    """Per collective kind, the most any rank counted (a rank without it counts 0)."""
    per_rank = list(values)
    kinds = sorted({k for counts in per_rank for k in counts})
    return {k: max(counts.get(k, 0) for counts in per_rank) for k in kinds}


def _first(values: Iterable[Any]) -> Any:
    return next(iter(values))


#: :data:`disagg.metrics.fields.Reduction` -> how it reduces the ranks' values
_REDUCE: dict[str, Callable[[Iterable[Any]], Any]] = {
    "max": max,
    "sum": sum,
    "first": _first,
    "max_by_kind": _max_by_kind,
}


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
    #: per cached encoder module, its feature cache's counts (``hits``, ``misses``, ``bytes``)
    cache: dict[str, dict[str, int]] = field(default_factory=dict)
