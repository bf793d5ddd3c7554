"""Bytes one rank sends per optimizer step, by collective kind.

Counted as :class:`disagg.interfaces.CommCounter` counts (textbook ring
algorithms, what one rank *sends*): all-reduce of ``b`` bytes over ``n`` ranks
sends ``2(n-1)b/n`` (floored per call), all-gather/reduce-scatter of shards of
``b`` bytes send ``(n-1)b``, an all-to-all sends everything but its own chunk,
a broadcast is counted on its source. ``transfer`` is what the rank ships to
the other group (encoder output rows forward, embedding gradients backward).
Every figure is for the busiest rank of the group (the orchestrator reports the
maximum over ranks).

Notation: ``W = degree x replicas`` ranks; a replica gets ``s = ceil(samples /
replicas)`` samples of ``N`` tokens (vision: patches); ``e`` bytes per
activation element (the compute dtype); gradients are fp32 (4 bytes) under the
dtype rule; ``H`` hidden, ``I`` MLP width, ``O`` the merger's output width,
``U`` patches per merged row (merge²), ``F`` full-attention blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.cost.buckets import bucket_sizes
from disagg.cost.memory import DEEPSPEED_PERSISTENCE
from disagg.cost.shapes import DecoderShape, VisionShape

GRAD_BYTES = 4  # parameters, gradients and optimizer state stay fp32 (disagg.interfaces.compute_dtype)


@dataclass(frozen=True)
class Workload:
    """One optimizer step of one group, as the cost formulas see it."""

    degree: int
    replicas: int
    #: tokens per sample entering the module (vision: patches; llm: sequence length)
    seq_len: int
    #: samples in the global batch
    samples: int
    #: microbatches per step (each replica gets ceil(samples / (microbatches x replicas)) per microbatch)
    microbatches: int = 1
    #: bytes per activation element (2 under bf16 autocast, 4 in fp32)
    act_bytes: int = 4
    #: rows per sample the module exchanges with the other group (vision: N / merge²; llm: vision rows)
    exchanged_rows: int = 0
    #: width of those rows
    exchanged_width: int = 0

    @property
    def world(self) -> int:
        return self.degree * self.replicas

    @property
    def samples_per_replica(self) -> int:
        return -(-self.samples // self.replicas)

    @property
    def tokens_per_replica(self) -> int:
        return self.samples_per_replica * self.seq_len


def all_reduce(nbytes: int, n: int) -> int:
    return 2 * (n - 1) * nbytes // n if n > 1 else 0


def grad_all_reduce(tensors: list[int], n: int) -> int:
    """``Strategy.reduce_gradients`` of the base class: ``agree_on_grads`` (one int32
    per tensor) then one all-reduce per 25 MiB bucket of gradients (torch DDP's
    bucketing, :func:`disagg.interfaces.bucket_sizes`)."""
    if n == 1:
        return 0
    buckets = bucket_sizes(tensors, GRAD_BYTES)
    return all_reduce(4 * len(tensors), n) + sum(
        all_reduce(GRAD_BYTES * sum(tensors[i] for i in b), n) for b in buckets
    )


def replicated_comm(numels: list[int], w: Workload) -> dict[str, int]:
    """``ddp`` and the gradient side of ``ulysses``: every rank holds every
    parameter; gradients are summed over the whole group."""
    return {"all_reduce": grad_all_reduce(numels, w.world)}


def ulysses_comm(shape: VisionShape, w: Workload) -> dict[str, int]:
    """Per full-attention block, forward: q/k/v of the rank's ``n = sN/d`` tokens
    for the other shards' heads ``(d-1)·n·3·(H/d)·e`` and the attention output of
    the other shards' tokens for its heads ``(sN - n)·(H/d)·e``; backward sends the
    same two exchanges reversed. With an even split (``n = sN/d``, true when each
    replica's tokens per microbatch divide into ``d`` whole attention windows) that
    is ``8·(d-1)·n·(H/d)·e`` per block; window blocks move nothing. Exact."""
    d = w.degree
    n_local = w.tokens_per_replica // d
    a2a = len(shape.full_blocks) * 8 * (d - 1) * n_local * (shape.hidden // d) * w.act_bytes if d > 1 else 0
    out = replicated_comm([t.numel for t in shape.tensors()], w)
    if a2a:
        out["all_to_all"] = a2a
    return out


def megatron_vision_comm(shape: VisionShape, w: Workload, sequence_parallel: bool) -> dict[str, int]:
    """Without sequence parallelism, per block and sample: the column layers
    (qkv, gate, up) all-reduce their input gradient and the row layers (proj, down)
    their output: ``5 · ar(N·H·e)``; the merger adds ``ar(N·H·e)`` (mlp.0's input
    gradient) and ``ar(N/U·O·e)`` (mlp.2's output). Shard 0 broadcasts the output
    gradient to its peers in backward (``N/U·O·e``). Replicas > 1 all-reduce every
    local gradient in one flat buffer; the global norm is one float64 all-reduce.
    Exact without sequence parallelism.

    With it (an estimate, not asserted): per block the two norm gathers (all-gather
    forward, reduce-scatter backward, one re-gather of the saved shard) and the two
    row reduce-scatters (all-gather backward): 6 all-gathers and 4 reduce-scatters of
    ``(d-1)·ceil(N/d)·H·e``; the merger's norm gather adds 2 + 1, the first block's
    split 1 all-gather in backward."""
    d, s, n = w.degree, w.samples_per_replica, w.seq_len
    h, e = shape.hidden, w.act_bytes
    rows = n // shape.unit
    out: dict[str, int] = {}
    if not sequence_parallel:
        per_sample = (5 * shape.depth + 1) * all_reduce(n * h * e, d) + all_reduce(
            rows * shape.out_hidden * e, d
        )
        out["all_reduce"] = s * per_sample
    else:
        c = -(-n // d)
        shard = (d - 1) * c * h * e
        out["all_gather"] = s * (6 * shape.depth + 3) * shard
        out["reduce_scatter"] = s * (4 * shape.depth + 1) * shard
        out["all_reduce"] = s * all_reduce(rows * shape.out_hidden * e, d)
        partial = [t.numel for t in shape.tensors() if t.tp == "replicated" and "patch_embed" not in t.name]
        out["all_reduce"] += all_reduce(GRAD_BYTES * sum(partial), w.world)
    if d > 1:
        out["broadcast"] = s * rows * shape.out_hidden * e
    out["all_reduce"] = out.get("all_reduce", 0) + _tp_grad_reduce(shape.tensors(), w)
    return out


def megatron_llm_comm(shape: DecoderShape, w: Workload, sequence_parallel: bool) -> dict[str, int]:
    """Per layer and sample of ``N`` tokens: q, k, v, gate, up all-reduce their input
    gradient, o and down their output (``7 · ar(N·H·e)``); the vocabulary-parallel
    embedding all-reduces its output and the output layer its input gradient; the
    vocabulary-parallel cross entropy all-reduces three fp32 values per token. With
    sequence parallelism the layer all-reduces become all-gathers/reduce-scatters of
    ``ceil(N/d)`` tokens. An estimate (the exact figure depends on which tokens
    require a gradient)."""
    d, s, n = w.degree, w.samples_per_replica, w.seq_len
    h, e = shape.hidden, w.act_bytes
    out: dict[str, int] = {}
    per = all_reduce(n * h * e, d) + 3 * 2 * (d - 1) * 4 * n // max(d, 1)
    partial = 0
    if not sequence_parallel:
        per += (7 * shape.layers + 1) * all_reduce(n * h * e, d)
    else:
        c = -(-n // d)
        shard = (d - 1) * c * h * e
        out["all_gather"] = s * (6 * shape.layers + 3) * shard
        out["reduce_scatter"] = s * (4 * shape.layers + 1) * shard
        norms = [t.numel for t in shape.tensors() if t.tp == "replicated"]
        partial = all_reduce(GRAD_BYTES * sum(norms), w.world)
    out["all_reduce"] = s * per + partial + _tp_grad_reduce(shape.tensors(), w)
    return out


def _tp_grad_reduce(tensors: list, w: Workload) -> int:
    """``agree_on_grads`` over the group (one int32 per tensor), replicas sum
    their local gradients (one flat buffer), the global grad norm is one float64
    scalar all-reduced over the group."""
    agree = all_reduce(4 * len(tensors), w.world)
    dp = all_reduce(GRAD_BYTES * sum(t.local_numel(w.degree) for t in tensors), w.replicas)
    return agree + dp + all_reduce(8, w.world)


#: bytes of the two scalars DeepSpeed all-reduces per step (its gradient norm in
#: ``zero``'s grad_norm_sq and again in its step), by stage: fp32 for stages 1-2,
#: 8 bytes for stage 3 (measured on DeepSpeed 0.19, gloo)
ZERO_STEP_SCALARS = {1: (4, 4), 2: (4, 4), 3: (8, 8)}


def zero_comm(
    tensors: list[int],
    stage: int,
    w: Workload,
    calls_per_mb: int = 2,
    persistence_threshold: int = DEEPSPEED_PERSISTENCE,
) -> dict[str, int]:
    """What DeepSpeed 0.19 sends per step under ``zero`` (``zero`` counts its real
    calls, :mod:`disagg_zero.comm`; ``tests`` compare the two), with ``f = (n-1)/n``,
    ``G = P`` the fp32 gradient / parameter bytes, ``m`` microbatches:

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
    on the uneven ZeRO test's larger encoder, not modelled): a lower bound there."""
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


def transfer_bytes(strategy: str, w: Workload) -> int:
    """Rows shipped to the other group: every ``ulysses`` rank its ``1/d`` of the
    rows, shard 0 of a TP group all of its replica's rows, ``ddp``/``zero`` ranks
    their own samples' rows."""
    rows = w.samples_per_replica * w.exchanged_rows
    if strategy == "ulysses":
        rows //= w.degree
    return rows * w.exchanged_width * w.act_bytes
