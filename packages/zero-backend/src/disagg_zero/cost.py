"""``zero``'s cost: what DeepSpeed 0.19 holds and sends per step, stage 1/2/3.

**Bytes** (``zero`` counts its real calls, :mod:`disagg_zero.comm`; the ZeRO
tests compare the two), with ``f = (n-1)/n``, ``G = P`` the fp32 gradient /
parameter bytes, ``m`` microbatches:

- stage 1: gradients all-reduced once per step (``2fG``), updated parameter
  partitions all-gathered after the step (``fP``, the flat buffer padded to a
  multiple of ``2n`` elements);
- stage 2: gradients all-reduced in every backward, i.e. every microbatch
  (``m·2fG``: ZeRO-2's default ``use_multi_rank_bucket_allreduce`` all-reduces
  each bucket rather than reduce-scattering it), then ``fP`` all-gathered;
- stage 3: the whole module gathered once per strategy call (``c`` calls per
  microbatch: an encoder's encode and backward, ``c = 2``; the LLM's
  forward-backward, ``c = 1``), each tensor over the persistence threshold
  from its own padded partition (``(n-1)·ceil(numel/n)`` elements), the
  persistent ones re-gathered once after the step; gradients reduce-scattered
  in every backward, each tensor padded the same way (``m·(n-1)·Σ ceil(numel/n)``);
- every stage: ``zero``'s agreement all-reduce (one int64 per trainable tensor,
  plus one) and DeepSpeed's two scalar all-reduces (:data:`ZERO_STEP_SCALARS`).

Equal to the measured count, byte for byte and call for call, for the toy
models at 2 and 3 ranks, every stage (one bucket: several buckets would each
be padded), with every tensor partitioned or every tensor persistent. With
persistent tensors mixed among partitioned ones, DeepSpeed 0.19 also
re-gathers the persistent ones at up to every whole-module gather (measured
on the uneven ZeRO test's larger encoder, not modelled): a lower bound there.

**State** after a step in fp32 training (``disagg_zero`` counts the storages
themselves), over ``n`` ranks and ``ψ`` elements: stages 1-2 keep the whole
parameters and an fp32 master partition with its two moments, ``4ψ + 12ψ/n``
(DeepSpeed frees their gradients in the step); stage 3 keeps each tensor's
partition ``ceil(k/n)``, its own fp32 master copy, a gradient partition and the
two moments, ``20·Σceil(k/n)``, plus the tensors of at most
``stage3_param_persistence_threshold`` elements whole on every rank. Not the
ZeRO paper's ``16ψ/n``: the paper counts mixed precision, where the master copy
replaces an fp32 parameter. Estimates within per-tensor scalars.

**Gathered** (``Cost.gathered_bytes``), stage 3: each strategy call (an encoder's
encode or backward, the LLM's forward-backward, evaluation) gathers the whole
module for the call (:func:`disagg_zero.runtime.gathered`), so at the peak a rank
holds every tensor over the persistence threshold whole in fp32 on top of its
state, ``4·Σ{k > threshold}`` (the persistent ones are whole in the state
already). Under bf16 autocast the forward's bf16 copies of those weights, saved
for backward, come on top and are not counted here. Not DeepSpeed's per-layer
gathering with prefetch (one layer plus a prefetch bucket at a time), which
``zero`` does not run yet: its every-rank-same-collectives guarantee rests on the
whole-module gather (``disagg_zero.strategy``). Stages 1-2 keep whole parameters
in the state.

So in the published 32B setting (8 ranks) uniform ZeRO-3 fits at no length, and
the groups the prediction prints say why: the LLM's ``state_bytes`` (20 B per
parameter over 8 ranks) and its ``gathered_bytes`` (4 B per parameter) each
exceed a GPU. The paper's ZeRO-3 (bf16, per layer) ran out at 16k for what it
holds per token; this model reproduces that only once ``zero`` gathers per
layer and runs DeepSpeed's bf16 mode.

Saved activations are a whole replica's, as under ``ddp``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from disagg.interfaces.chunked_loss import DEFAULT_CHUNK_TOKENS
from disagg.interfaces.cost import GRAD_BYTES, Cost, CostQuery, ParamTensor, Workload, assemble, held_tokens
from disagg.interfaces.cost import workload as workload_of
from disagg.interfaces.cost_rules import (
    all_reduce,
    extra_flops,
    recompute_mode,
    replica_activation_bytes,
    train_flops,
    transfer_bytes,
)
from disagg.interfaces.gemms import Split, strategy_compute

#: DeepSpeed's default stage3_param_persistence_threshold (deepspeed/runtime/zero/config.py)
DEEPSPEED_PERSISTENCE = 100_000
#: DeepSpeed's default ``reduce_bucket_size`` / ``allgather_bucket_size`` (elements),
#: deepspeed/runtime/zero/config.py (ZERO_REDUCE_BUCKET_SIZE_DEFAULT = 5e8)
DEEPSPEED_BUCKET = 500_000_000
#: bytes of the two scalars DeepSpeed all-reduces per step (its gradient norm in
#: ``zero``'s grad_norm_sq and again in its step), by stage: fp32 for stages 1-2,
#: 8 bytes for stage 3 (measured on DeepSpeed 0.19, gloo)
ZERO_STEP_SCALARS = {1: (4, 4), 2: (4, 4), 3: (8, 8)}
#: searched by ``disagg plan``
OPTION_VARIANTS: list[dict[str, Any]] = [{"stage": 1}, {"stage": 2}, {"stage": 3}]


def zero_comm(
    tensors: list[int],
    stage: int,
    w: Workload,
    calls_per_mb: int = 2,
    persistence_threshold: int = DEEPSPEED_PERSISTENCE,
) -> dict[str, int]:
    """Bytes per rank per step by kind (the module docstring)."""
    n = w.world
    if n == 1:
        return {}
    m = w.microbatches
    grads = sum(tensors) * GRAD_BYTES
    small = all_reduce(8 * (len(tensors) + 1), n) + sum(all_reduce(b, n) for b in ZERO_STEP_SCALARS[stage])
    # the flat fp32 partitions of stages 1-2 are padded to a multiple of 2n elements
    # (DeepSpeed's nccl_start_alignment_factor = 2): each rank gathers its padded share
    flat = (n - 1) * -(-sum(tensors) // (2 * n)) * 2 * GRAD_BYTES
    if stage == 1:
        return {"all_reduce": all_reduce(grads, n) + small, "all_gather": flat}
    if stage == 2:
        return {"all_reduce": m * all_reduce(grads, n) + small, "all_gather": flat}
    shard = [(n - 1) * -(-k // n) * GRAD_BYTES for k in tensors]
    persistent = sum(b for b, k in zip(shard, tensors) if k <= persistence_threshold)
    gathered = sum(shard) - persistent
    return {
        "all_gather": calls_per_mb * m * gathered + persistent,
        "reduce_scatter": m * sum(shard),
        "all_reduce": small,
    }


def zero_calls(
    tensors: list[ParamTensor],
    stage: int,
    w: Workload,
    bucket: int = DEEPSPEED_BUCKET,
    calls_per_mb: int = 2,
    persistence_threshold: int = DEEPSPEED_PERSISTENCE,
) -> dict[str, int]:
    """DeepSpeed's collectives, as :func:`zero_comm` sums their bytes, in buckets of
    ``bucket`` elements (``B = ceil(P / bucket)`` calls per reduction): stage 1
    all-reduces gradients once per step (``B``), stage 2 in every backward
    (``M·B``), both all-gather the updated partitions (``B``); stage 3 gathers one
    tensor per call, ``calls_per_mb·M·T`` for the ``T`` tensors over the persistence
    threshold plus the persistent ones once after the step, and reduce-scatters in
    every backward (``M·B``). Every stage: ``zero``'s agreement all-reduce and
    DeepSpeed's two scalar all-reduces (3)."""
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


def zero_state_bytes(
    numels: list[int], stage: int, n: int, persistence_threshold: int = DEEPSPEED_PERSISTENCE
) -> int:
    """DeepSpeed's holdings after a step, fp32 training (see the module docstring)."""
    psi = sum(numels)
    if stage < 3:
        return 4 * psi + 12 * -(-psi // n)
    parts = sum(-(-k // n) for k in numels)
    return 20 * parts + 4 * sum(k for k in numels if k <= persistence_threshold)


def zero_gathered_bytes(
    numels: list[int], stage: int, persistence_threshold: int = DEEPSPEED_PERSISTENCE
) -> int:
    """Stage 3: the fp32 parameters a strategy call holds whole on top of the state
    (every tensor over the persistence threshold; the module docstring)."""
    if stage < 3:
        return 0
    return GRAD_BYTES * sum(k for k in numels if k > persistence_threshold)


def estimate(
    query: CostQuery,
    stage: int,
    persistence_threshold: int = DEEPSPEED_PERSISTENCE,
    recompute: str = "none",
    offload_optimizer: bool = False,
    chunk: int | None = DEFAULT_CHUNK_TOKENS,
) -> Cost:
    """``recompute``: the strategy's own option, used where the query names none;
    ``offload_optimizer`` keeps the fp32 master partition and the two moments
    (12 bytes per element, partitioned) off the GPU; ``chunk``: the LLM's
    ``loss_chunk_tokens`` (logits of one chunk held at once; None: the whole microbatch's)."""
    if recompute != "none" and not query.recompute:
        query = replace(query, recompute=recompute)
    mode = recompute_mode(query.recompute)
    w = workload_of(query)
    shape = query.shape
    tensors = shape.tensors()
    numels = [t.numel for t in tensors]
    per_call = 2 if query.encoder else 1
    tokens = held_tokens(query, w)
    act = replica_activation_bytes(shape, mode, tokens, w.act_bytes, chunk)
    work = train_flops(shape, query.seq_len)
    work += extra_flops(shape, query.seq_len, work, mode)
    cost = assemble(
        w,
        state_bytes=zero_state_bytes(numels, stage, w.world, persistence_threshold),
        activation_bytes=act,
        comm=zero_comm(numels, stage, w, calls_per_mb=per_call, persistence_threshold=persistence_threshold),
        calls=zero_calls(
            tensors, stage, w, calls_per_mb=per_call, persistence_threshold=persistence_threshold
        ),
        flops_per_sample=work,
        share=1,
        sent_bytes=transfer_bytes(w),
        compute=strategy_compute(shape, query.seq_len, Split(), w.act_bytes, mode),
    )
    cost = replace(cost, gathered_bytes=zero_gathered_bytes(numels, stage, persistence_threshold))
    if offload_optimizer:
        numel = sum(numels)
        cost = replace(cost, state_bytes=cost.state_bytes - 12 * -(-numel // w.world))
    return cost
