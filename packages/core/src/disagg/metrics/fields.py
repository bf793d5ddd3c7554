"""Every field of a ``metrics.jsonl`` step record, defined once: its name, what it
is per (the step, each group, each GPU), its unit, how a group's ranks reduce to
it and what it means.

:func:`disagg.metrics.record.reduce_group`, :func:`disagg.metrics.step.step_record`
and the table in ``docs/metrics.md`` (:mod:`disagg.metrics.reference`) are all
generated from :data:`FIELDS` and :data:`EVAL_FIELDS`; a field added here appears in
all three, and a test fails while the page is stale.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from disagg.metrics.record import StepResult

#: how a group's per-rank values become the group's one value (``RankRecord`` attribute
#: ``source``): the slowest or fullest rank bounds the group (``max``), a total (``sum``),
#: what every rank holds alike (``first``), or per collective kind the most any rank counted
Reduction = Literal["max", "sum", "first", "max_by_kind"]
REDUCTIONS: dict[str, str] = {
    "max": "max over ranks",
    "sum": "sum over ranks",
    "first": "rank 0's (equal on every rank)",
    "max_by_kind": "max over ranks, per kind",
}


@dataclass(frozen=True)
class StepInputs:
    """What a step record is computed from: the orchestrator's :class:`StepResult`, the
    data pipeline's counters and the driver's per-group FLOP count and device peak."""

    step: int
    result: StepResult
    data_stats: dict[str, int]
    #: per group, the model's training FLOPs of this step (:mod:`disagg.metrics.flops`); a
    #: group whose family describes no shape is missing
    flops: dict[str, float]
    #: peak FLOP/s of one device in the run's precision (:mod:`disagg.metrics.peak`); None: unknown
    peak_flops: float | None

    def ranks(self, module: str) -> int:
        return len(self.result.records.get(module, ())) or 1


@dataclass(frozen=True)
class Field:
    """One field of the step record."""

    name: str
    #: ``step``: one value per step; ``group``: ``{module: value}``
    per: Literal["step", "group"]
    unit: str
    doc: str
    #: group fields reduced from every rank's :class:`~disagg.metrics.record.RankRecord`
    reduce: Reduction | None = None
    #: the ``RankRecord`` attribute reduced (default: ``name`` less a ``_per_rank`` suffix)
    source: str | None = None
    #: fields computed on the driver: the value from the step's inputs (a group field: per
    #: module, ``value(inputs, module)``; None leaves the module out); an ``EVAL_FIELDS`` entry's
    #: takes ``Orchestrator.evaluate``'s dict
    value: Callable[..., Any] | None = None

    @property
    def attribute(self) -> str:
        return self.source or self.name.removesuffix("_per_rank")


def _group_value(name: str) -> Callable[[StepInputs, str], Any]:
    return lambda x, m: x.result.groups[m][name]


def _flops(x: StepInputs, m: str) -> float | None:
    return x.flops.get(m)


def _mfu(x: StepInputs, m: str) -> float | None:
    f, t = x.flops.get(m), x.result.step_time_s
    if f is None or not x.peak_flops or t <= 0:
        return None
    return f / (t * x.ranks(m) * x.peak_flops)


def _active_tokens(x: StepInputs, m: str) -> float | None:
    t = x.result.step_time_s
    return x.result.module_tokens.get(m, 0) / (t * x.ranks(m)) if t > 0 else None


def _idle(x: StepInputs, m: str) -> float | None:
    t = x.result.step_time_s
    return min(1.0, x.result.groups[m]["wait_s"] / t) if t > 0 else None


def _cache(name: str) -> Callable[[StepInputs, str], Any]:
    return lambda x, m: x.result.cache[m][name] if m in x.result.cache else None


def _per_gpu(x: StepInputs) -> dict[str, dict[str, int]]:
    from disagg.metrics.record import per_gpu

    return per_gpu(x.result.records)


FIELDS: tuple[Field, ...] = (
    Field("step", "step", "", "the optimizer step, from 1", value=lambda x: x.step),
    Field(
        "loss",
        "step",
        "nats per label token",
        "the step's loss: sum over the global batch's label tokens / their count",
        value=lambda x: x.result.loss,
    ),
    Field(
        "grad_norm",
        "step",
        "",
        "the global gradient norm over every module, before clipping",
        value=lambda x: x.result.grad_norm,
    ),
    Field(
        "step_time_s",
        "step",
        "s",
        "wall seconds of the step, on the driver",
        value=lambda x: x.result.step_time_s,
    ),
    Field(
        "tokens_per_s",
        "step",
        "tokens/s",
        "`tokens / step_time_s`",
        value=lambda x: x.result.tokens / x.result.step_time_s if x.result.step_time_s > 0 else 0.0,
    ),
    Field(
        "tokens",
        "step",
        "tokens",
        "tokens of the global batch (the LLM's whole sequences)",
        value=lambda x: x.result.tokens,
    ),
    Field(
        "label_tokens",
        "step",
        "tokens",
        "label tokens of the global batch",
        value=lambda x: x.result.label_tokens,
    ),
    Field(
        "module_tokens",
        "group",
        "tokens",
        "tokens the module processed: an encoder's placeholder tokens (its output rows), "
        "the LLM's whole sequences",
        value=lambda x, m: x.result.module_tokens.get(m, 0),
    ),
    Field(
        "flops",
        "group",
        "FLOPs",
        "the model's training FLOPs of the step over the group's ranks: the count the strategies' cost "
        "hooks state (`disagg.kit.cost.rules.train_flops`: every matmul `2·m·n·k`, attention "
        "`QKᵀ`/`AV`, x3 for forward + backward; LoRA adapters added and frozen weights' weight-gradient "
        "products left out (`cost_training.flops_delta`); a `recompute` replay added), summed over the "
        "step's samples at their own lengths. Element-wise work (norms, softmax, activations, the "
        "optimizer) is not counted. Absent for a family that describes no shape (`planning_shape`)",
        value=_flops,
    ),
    Field(
        "mfu",
        "group",
        "fraction",
        "`flops / (step_time_s x ranks x peak)`: the group's FLOPs against its devices' peak over the "
        "whole step (idle time included), the peak of one device in the run's precision "
        "(`disagg.metrics.peak`: CUDA from the GPU model, CPU the `cpu` planning preset's); with "
        "`recompute` the replay counts (hardware FLOPs). Absent where `flops` or the peak is unknown",
        value=_mfu,
    ),
    Field(
        "active_tokens_per_s_per_device",
        "group",
        "tokens/s",
        "`module_tokens / (step_time_s x ranks)`: tokens without padding, per second per rank of the group",
        value=_active_tokens,
    ),
    Field(
        "idle_fraction",
        "group",
        "fraction",
        "`wait_s / step_time_s`: the share of the step the group's most-waiting rank was blocked "
        "on another module (its idle time within the step)",
        value=_idle,
    ),
    Field(
        "peak_mem_bytes",
        "group",
        "bytes",
        "CUDA: the allocator's allocated peak of the fullest rank; CPU: the fullest rank's max RSS",
        reduce="max",
    ),
    Field(
        "peak_reserved_bytes",
        "group",
        "bytes",
        "CUDA: the allocator's reserved peak of the fullest rank, cached blocks included",
        reduce="max",
    ),
    Field(
        "gpu_mem_bytes",
        "step",
        "bytes",
        "CUDA (`{}` on CPU): per GPU (`node:gpu`), `peak_reserved_bytes` (the reserved peaks of every "
        "process on it summed: collocated groups share GPUs) and `used_bytes` (its used memory at the "
        "step's end, CUDA contexts and NCCL buffers included)",
        value=_per_gpu,
    ),
    Field(
        "device_s",
        "group",
        "s",
        "CUDA: GPU time of the slowest rank, from CUDA events (`busy_s` is host time); 0 on CPU",
        reduce="max",
    ),
    Field(
        "comm_bytes",
        "group",
        "bytes",
        "collectives plus activations/gradients sent to other groups, summed over ranks",
        reduce="sum",
    ),
    Field("comm_bytes_per_rank", "group", "bytes", "the same, the most any rank sent", reduce="max"),
    Field(
        "collective_bytes_per_rank",
        "group",
        "bytes",
        "by collective kind (`all_reduce`, `all_to_all`, ...): the most any rank sent; ZeRO's are "
        "DeepSpeed's own `torch.distributed` calls, counted as they run by wrapping the collectives "
        "while DeepSpeed works (`disagg_zero/comm.py`)",
        reduce="max_by_kind",
    ),
    Field(
        "collective_calls_per_rank",
        "group",
        "calls",
        "by collective kind: the most any rank called",
        reduce="max_by_kind",
    ),
    Field(
        "overlapped_calls_per_rank",
        "group",
        "calls",
        "of the gradient all-reduces counted in `collective_calls_per_rank`, the most any rank sent "
        "while its last backward of the step still ran (`parallel.<module>.overlap_grad_reduce`; 0 when off)",
        reduce="max",
        source="overlapped_calls",
    ),
    Field("sent_bytes_per_rank", "group", "bytes", "the most any rank sent to other groups", reduce="max"),
    Field(
        "activation_bytes_per_rank",
        "group",
        "bytes",
        "the most bytes autograd held saved for backward at once (all microbatches in flight)",
        reduce="max",
    ),
    Field(
        "state_bytes_per_rank",
        "group",
        "bytes",
        "parameters + gradients + optimizer state",
        reduce="max",
    ),
    Field(
        "busy_s",
        "group",
        "s",
        "host seconds the slowest rank spent inside the step's calls, waits on other groups excluded "
        "(set-up, checkpoints and evaluation count toward no step, so it never exceeds `step_time_s`); "
        "called `group_time_s` before, which `disagg plot` and `disagg bench` still read",
        reduce="max",
    ),
    Field(
        "wait_s",
        "group",
        "s",
        "the longest a rank was blocked on another group's shards or gradients",
        reduce="max",
    ),
    Field("lr", "group", "", "the learning rate of the step", reduce="first"),
    Field(
        "encode_calls_per_rank",
        "group",
        "calls",
        "encoder forward calls with at least one sample, the most any rank ran (0 for the LLM; "
        "a step whose samples all hit the feature cache runs none)",
        reduce="max",
        source="encode_calls",
    ),
    Field(
        "encode_busy_s",
        "group",
        "s",
        "of `busy_s`, the slowest rank's host seconds in the encoder's work on samples (its forward, "
        "sending shards, keeping outputs in the feature cache): what cache hits save; 0 for the LLM",
        reduce="max",
        source="encode_s",
    ),
    Field(
        "cache_hits",
        "group",
        "samples",
        "`parallel.<module>.feature_cache`: the step's samples whose encoder output came from the "
        "cache (the encoder skipped them); absent for a module without a cache",
        value=_cache("hits"),
    ),
    Field(
        "cache_misses",
        "group",
        "samples",
        "the step's samples with the module's media that the cache did not hold (encoded, then kept)",
        value=_cache("misses"),
    ),
    Field(
        "cache_bytes",
        "group",
        "bytes",
        "bytes the module's feature cache holds after the step (host: object store; disk: files)",
        value=_cache("bytes"),
    ),
    Field(
        "skipped_samples",
        "step",
        "samples",
        "samples skipped by `data.on_error: skip`, so far",
        value=lambda x: int(x.data_stats.get("skipped", 0)),
    ),
    Field(
        "dropped_too_long",
        "step",
        "samples",
        "samples dropped by `data.on_too_long: drop`, so far",
        value=lambda x: int(x.data_stats.get("dropped_too_long", 0)),
    ),
    Field(
        "truncated_too_long",
        "step",
        "samples",
        "samples cut by `data.on_too_long: truncate`, so far",
        value=lambda x: int(x.data_stats.get("truncated", 0)),
    ),
)

#: the ``eval_*`` fields of a step that evaluated, from ``Orchestrator.evaluate``'s dict
EVAL_FIELDS: tuple[Field, ...] = (
    Field(
        "eval_loss", "step", "nats per label token", "the loss over the eval set", value=lambda ev: ev["loss"]
    ),
    Field(
        "eval_token_accuracy",
        "step",
        "fraction",
        "greedy next-token accuracy over the eval set's label tokens",
        value=lambda ev: ev["token_accuracy"],
    ),
    Field(
        "eval_label_tokens",
        "step",
        "tokens",
        "label tokens of the eval set",
        value=lambda ev: ev["label_tokens"],
    ),
    Field("eval_samples", "step", "samples", "samples of the eval set", value=lambda ev: ev["samples"]),
    Field(
        "eval_module_tokens",
        "group",
        "tokens",
        "per module, as `module_tokens`",
        value=lambda ev: dict(ev["tokens"]),
    ),
    Field("eval_time_s", "step", "s", "wall seconds of the evaluation", value=lambda ev: ev["time_s"]),
)

#: group fields reduced over ranks (by :func:`disagg.metrics.record.reduce_group`)
REDUCED = tuple(f for f in FIELDS if f.reduce is not None)

__all__ = ["EVAL_FIELDS", "FIELDS", "REDUCED", "REDUCTIONS", "Field", "StepInputs"]
