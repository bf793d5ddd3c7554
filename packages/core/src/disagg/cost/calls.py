"""Collective *calls* one rank makes per optimizer step, by kind.

The byte counts of :mod:`.comm` decide time when messages are large; when they
are small (short sequences, tiny models, many layers of small activations)
every call pays a fixed latency instead, whatever its size (the α of the
α-β model, :func:`disagg.plan.model.collective_seconds`). These counts follow the
same collectives :mod:`.comm` sums bytes over, call by call: a microbatch's
samples go through each layer together (one call per layer and microbatch,
not per sample), gradient reductions run once per step after the last
microbatch.

:class:`disagg.interfaces.CommCounter` counts calls beside bytes, and
``disagg bench`` reports them (``collective_calls_per_rank``): for ``ulysses``,
``megatron_tp`` (with and without sequence parallelism) and ``ddp`` these
counts equal the measured ones (``tests/test_bench.py``). ``zero``'s are
DeepSpeed's own calls, counted as they run by wrapping ``torch.distributed``
(:mod:`disagg_zero.comm`); :func:`zero_calls` equals that count on the ZeRO
tests' toy models (``packages/zero-backend/tests``).

Notation as in :mod:`.comm`; ``M`` microbatches per step, ``T`` parameter
tensors, ``L`` decoder layers / vision blocks, ``F`` full-attention blocks.
"""

from __future__ import annotations

from disagg.cost.buckets import bucket_sizes
from disagg.cost.comm import GRAD_BYTES, Workload
from disagg.cost.memory import DEEPSPEED_PERSISTENCE
from disagg.cost.shapes import DecoderShape, ParamTensor, Shape, VisionShape

#: DeepSpeed's default ``reduce_bucket_size`` / ``allgather_bucket_size`` (elements),
#: deepspeed/runtime/zero/config.py (ZERO_REDUCE_BUCKET_SIZE_DEFAULT = 5e8)
DEEPSPEED_BUCKET = 500_000_000


def grad_reduce_calls(tensors: list[int], n: int) -> dict[str, int]:
    """``Strategy.reduce_gradients`` of the base class (``ddp``, ``ulysses``):
    ``agree_on_grads`` then one all-reduce per 25 MiB bucket of the gradient
    tensors (element counts ``tensors``): ``1 + buckets``."""
    return {"all_reduce": 1 + len(bucket_sizes(tensors, GRAD_BYTES))} if n > 1 else {}


def tp_grad_calls(w: Workload) -> dict[str, int]:
    """``megatron_tp``'s reduction: ``agree_on_grads`` and the global-norm scalar over
    the group, one flat all-reduce over replicas when there are several."""
    if w.world == 1:
        return {}
    return {"all_reduce": 2 + (1 if w.replicas > 1 else 0)}


def ulysses_calls(shape: VisionShape, w: Workload) -> dict[str, int]:
    """Per full-attention block and microbatch: the q/k/v all-to-all and the output
    all-to-all forward, both again backward (``4·F·M``); window blocks move nothing;
    gradients summed over the group as ``ddp`` does."""
    out = grad_reduce_calls([t.numel for t in shape.tensors()], w.world)
    if w.degree > 1:
        out["all_to_all"] = 4 * len(shape.full_blocks) * w.microbatches
    return out


def megatron_vision_calls(shape: VisionShape, w: Workload, sequence_parallel: bool) -> dict[str, int]:
    """Per image (``megatron_tp`` encodes a microbatch's samples one by one: one
    image per sample here), as :func:`.comm.megatron_vision_comm` sums bytes:
    without sequence parallelism ``5·L + 2`` all-reduces (column input gradients,
    row outputs, the merger's two); with it ``6·L + 3`` all-gathers, ``4·L + 1``
    reduce-scatters and the merger's all-reduce; shard 0's broadcast of the output
    gradient. Once per step: the gradient reduction (and, with sequence
    parallelism, the partial norms' all-reduce)."""
    d, m = w.degree, max(w.samples_per_replica, w.microbatches)
    out = tp_grad_calls(w)
    if d > 1:
        if sequence_parallel:
            out["all_gather"] = m * (6 * shape.depth + 3)
            out["reduce_scatter"] = m * (4 * shape.depth + 1)
            out["all_reduce"] = out.get("all_reduce", 0) + m + 1
        else:
            out["all_reduce"] = out.get("all_reduce", 0) + m * (5 * shape.depth + 2)
        out["broadcast"] = m
    return out


def megatron_llm_calls(shape: DecoderShape, w: Workload, sequence_parallel: bool) -> dict[str, int]:
    """Per microbatch, as :func:`.comm.megatron_llm_comm` sums bytes: the vocabulary-
    parallel embedding's output all-reduce, the cross entropy's three (max, sum of
    exponentials, target logit), and without sequence parallelism ``7·L + 1``
    layer all-reduces (with it ``6·L + 3`` all-gathers and ``4·L + 1``
    reduce-scatters, and one all-reduce of the norms' partial gradients per step)."""
    d, m = w.degree, w.microbatches
    out = tp_grad_calls(w)
    if d > 1:
        per = 1 + 3
        if sequence_parallel:
            out["all_gather"] = m * (6 * shape.layers + 3)
            out["reduce_scatter"] = m * (4 * shape.layers + 1)
            out["all_reduce"] = out.get("all_reduce", 0) + 1
        else:
            per += 7 * shape.layers + 1
        out["all_reduce"] = out.get("all_reduce", 0) + m * per
    return out


def zero_calls(
    tensors: list[ParamTensor],
    stage: int,
    w: Workload,
    bucket: int = DEEPSPEED_BUCKET,
    calls_per_mb: int = 2,
    persistence_threshold: int = DEEPSPEED_PERSISTENCE,
) -> dict[str, int]:
    """DeepSpeed 0.19's collectives under ``zero``, as :func:`disagg.cost.comm.zero_comm`
    sums their bytes, in buckets of ``bucket`` elements (``B = ceil(P / bucket)``
    calls per reduction): stage 1 all-reduces gradients once per step (``B``),
    stage 2 in every backward (``M·B``), both all-gather the updated partitions
    (``B``); stage 3 gathers one tensor per call, ``calls_per_mb·M·T`` for the
    ``T`` tensors over the persistence threshold plus the persistent ones once
    after the step, and reduce-scatters in every backward (``M·B``). Every stage:
    ``zero``'s agreement all-reduce and DeepSpeed's two scalar all-reduces (3).
    With persistent tensors mixed among partitioned ones, a lower bound (see
    :func:`disagg.cost.comm.zero_comm`)."""
    if w.world == 1:
        return {}
    numel = sum(t.numel for t in tensors)
    buckets = max(1, -(-numel // bucket))
    small = 3
    if stage == 3:
        persistent = sum(t.numel <= persistence_threshold for t in tensors)
        gathers = calls_per_mb * w.microbatches * (len(tensors) - persistent) + persistent
        return {"all_gather": gathers, "reduce_scatter": w.microbatches * buckets, "all_reduce": small}
    reductions = buckets if stage == 1 else w.microbatches * buckets
    return {"all_reduce": reductions + small, "all_gather": buckets}


def collective_calls(
    shape: Shape,
    strategy: str,
    w: Workload,
    *,
    sequence_parallel: bool = False,
    stage: int = 3,
    persistence_threshold: int = DEEPSPEED_PERSISTENCE,
) -> dict[str, int]:
    """Calls per rank per step of ``strategy`` (core's four) for ``shape`` on ``w``."""
    if strategy == "ulysses":
        assert isinstance(shape, VisionShape)
        out = ulysses_calls(shape, w)
    elif strategy == "megatron_tp":
        out = (
            megatron_vision_calls(shape, w, sequence_parallel)
            if isinstance(shape, VisionShape)
            else megatron_llm_calls(shape, w, sequence_parallel)  # type: ignore[arg-type]
        )
    elif strategy == "zero":
        out = zero_calls(
            shape.tensors(),
            stage,
            w,
            calls_per_mb=2 if isinstance(shape, VisionShape) else 1,
            persistence_threshold=persistence_threshold,
        )
    else:
        out = grad_reduce_calls([t.numel for t in shape.tensors()], w.world)
    return {k: v for k, v in out.items() if v}
