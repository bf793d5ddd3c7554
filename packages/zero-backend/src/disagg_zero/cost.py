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
- stage 3: DeepSpeed gathers each submodule's parameters before its forward and again
  before its backward (:mod:`disagg_zero.perlayer`), each tensor over the persistence
  threshold from its own padded partition (``(n-1)·ceil(numel/n)`` elements), ``u`` times per
  step (:func:`zero3_uses`: twice per pass, recomputed or not (a replay gathers what its
  backward then uses: :func:`disagg_zero.runtime.keep_replayed`), the output head twice per
  loss chunk, an encoder's first module (fed by data) once per pass and once per microbatch's
  backward; an encoder's pass is one root call per sample, the LLM's one per microbatch); the persistent
  ones re-gathered once after the step; gradients reduce-scattered in every backward, each
  tensor padded the same way (``m·(n-1)·Σ ceil(numel/n)``); plus the group's agreement on its
  calls (:mod:`disagg.kit.lockstep`: an encoder's vote per root call and one more per
  microbatch, the LLM's sample and chunk counts), 8-byte all-reduces. Not modelled:
  DeepSpeed's trace checks (a few small all-reduces and broadcasts at a root forward while
  it records its trace), and gathers saved when a parameter is kept for reuse
  (``stage3_max_reuse_distance``) or fetched early by prefetch (fewer, larger calls):
  the model is the no-reuse count;
- every stage: ``zero``'s agreement all-reduce (one int64 per trainable tensor,
  plus one) and DeepSpeed's two scalar all-reduces (:data:`ZERO_STEP_SCALARS`).

Equal to the measured count, byte for byte and call for call, for the toy
models at 2 and 3 ranks, every stage (one bucket: several buckets would each
be padded), with every tensor partitioned or every tensor persistent. With
persistent tensors mixed among partitioned ones, DeepSpeed 0.19 also
re-gathers the persistent ones at up to every whole-module gather (measured
on the uneven ZeRO test's larger encoder, not modelled): a lower bound there.

**State** after a step (``disagg_zero`` counts the storages themselves), over ``n`` ranks and
``ψ`` trained elements, under the ``train.precision`` recipe (DeepSpeed's mode for it,
``dsconfig.PRECISION_SECTIONS``; :func:`ds_bytes`: ``w`` the weight, ``m`` the master partition,
``g`` the gradient, ``a`` the two moments, in bytes per element):

============  ====================================  ================================
recipe        stages 1-2: ``wψ + (m + a)ψ/n``        stage 3: ``(w + m + g + a)ψ/n``
============  ====================================  ================================
``fp32``      ``4ψ + 12ψ/n``                         ``20ψ/n``
``bf16``      ``2ψ + 12ψ/n`` (stage 1: ``+ 4ψ``)     ``18ψ/n``
``bf16-pure`` ``2ψ + 6ψ/n``                          ``10ψ/n``
============  ====================================  ================================

Stages 1-2 keep the whole parameters (DeepSpeed frees their gradients in the step) and a master
partition with its two moments, except stage 1 under ``bf16``: DeepSpeed's ``BF16_Optimizer``
keeps the whole fp32 gradient it accumulates and all-reduces in. Stage 3 keeps each tensor's
partition ``ceil(k/n)``, a master copy, a gradient partition and the two moments, plus the
tensors of at most ``stage3_param_persistence_threshold`` elements whole on every rank. The
master is a separate copy even where it has the weight's dtype (``fp32``, and ``bf16-pure``'s
bf16 master: DeepSpeed 0.19 means to share the partition then, but compares a device with a
string, so never does), hence 20 and 10 bytes at stage 3 where the recipes' own table says 16
and 8, and ``bf16-pure``'s 2 bytes over ``n`` in stages 1-2. Not the ZeRO paper's ``16ψ/n``:
it counts an fp16 gradient. Estimates within per-tensor scalars; measured equal under every
recipe and stage (``packages/zero-backend/tests/test_zero_recipes.py``).

**Gathered** (``Cost.gathered_bytes``), stage 3: what DeepSpeed's per-submodule gathering
holds whole at once on top of the state (:func:`zero_gathered_bytes`): the largest one
module's own partitioned tensors (the one being computed; under full recompute the largest
layer's, which its replay gathers for its backward); with prefetch on
(``stage3_prefetch_bucket_size`` > 0), what it fetches ahead, which each fetch tops up to
``stage3_max_live_parameters``; what it keeps for reuse (up to ``stage3_max_reuse_distance``
elements); an encoder's first module, fed by data, which DeepSpeed's post-backward hook never
releases before the end of the backward; never more than the whole module's partitioned
tensors. Measured on the tiny models (``runtime.GatherProbe``): with prefetch and reuse off,
exactly the largest module's tensors (plus the encoder's first module); with a prefetch bucket,
within the bound. Stages 1-2 keep whole parameters in the state.

So in the published 32B setting (8 ranks) a ZeRO-3 LLM rank holds its state (18 B per
parameter over 8 ranks under ``bf16``: 73.7 GB; 20 B in ``fp32``: 81.9 GB) plus the embedding
or output head gathered whole with DeepSpeed's default live-parameter limit and reuse window (a
few GB), not the module: under either recipe that is more than an 80 GB GPU before any
activation (``disagg.bench.published_fit``).

**Buffers** (``Cost.buffer_bytes``), stage 3: DeepSpeed's ZeRO-3 optimizer allocates its
gradient reduce bucket at set-up and keeps it for the run (``stage3.py``:
``torch.empty(reduce_bucket_size)`` in the communication dtype when ``contiguous_gradients``):
``reduce_bucket_size`` (5e8 elements by default) x the recipe's reduction bytes
(:func:`zero_buffer_bytes`): 2 GB per rank under ``fp32`` and ``bf16`` (whose gradients
``dsconfig`` reduces in fp32), 1 GB under ``bf16-pure``. Measured by the allocator-peak test
(``tests/test_allocator_peak.py``, where it was the one term missing). Stages 1-2's buckets
(allocated at each backward's prologue by ``DeepSpeedZeroOptimizer``) are not counted yet.

**Bytes under the bf16 recipes**: the gathers carry the weight's dtype (2 bytes), the gradient
reductions the recipe's (``bf16``: fp32, 4 bytes; ``bf16-pure``: 2); counted call for call in
``fp32`` only.

Saved activations are a whole replica's, as under ``ddp``.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from disagg.interfaces.compute import Split
from disagg.interfaces.cost import GRAD_BYTES, Cost, CostQuery, ParamTensor, Workload
from disagg.interfaces.precision import RECIPES
from disagg.interfaces.strategy import DEFAULT_CHUNK_TOKENS
from disagg.kit.cost import training as cost_training
from disagg.kit.cost.assemble import assemble, held_tokens
from disagg.kit.cost.assemble import workload as workload_of
from disagg.kit.cost.gemms import strategy_compute
from disagg.kit.cost.rules import (
    all_reduce,
    extra_flops,
    recompute_mode,
    replica_activation_bytes,
    train_flops,
    transfer_bytes,
)
from disagg.kit.cost.training import query_trained

#: DeepSpeed's default stage3_param_persistence_threshold (deepspeed/runtime/zero/config.py)
DEEPSPEED_PERSISTENCE = 100_000
#: DeepSpeed's default ``reduce_bucket_size`` / ``allgather_bucket_size`` (elements),
#: deepspeed/runtime/zero/config.py (ZERO_REDUCE_BUCKET_SIZE_DEFAULT = 5e8)
DEEPSPEED_BUCKET = 500_000_000
#: bytes of the two scalars DeepSpeed all-reduces per step (its gradient norm in
#: ``zero``'s grad_norm_sq and again in its step), by stage: fp32 for stages 1-2,
#: 8 bytes for stage 3 (measured on DeepSpeed 0.19, gloo)
ZERO_STEP_SCALARS = {1: (4, 4), 2: (4, 4), 3: (8, 8)}
#: DeepSpeed's ZeRO-3 defaults (deepspeed/runtime/zero/config.py), elements:
#: stage3_prefetch_bucket_size, stage3_max_live_parameters, stage3_max_reuse_distance
DEEPSPEED_PREFETCH = 50_000_000
DEEPSPEED_MAX_LIVE = 1_000_000_000
DEEPSPEED_REUSE = 1_000_000_000
#: bytes of one agreement all-reduce of :mod:`disagg.kit.lockstep` (one int64)
VOTE_BYTES = 8
#: searched by ``disagg plan``
OPTION_VARIANTS: list[dict[str, Any]] = [{"stage": 1}, {"stage": 2}, {"stage": 3}]


def zero_comm(
    tensors: list[int],
    stage: int,
    w: Workload,
    persistence_threshold: int = DEEPSPEED_PERSISTENCE,
    uses: list[int] | None = None,
    votes: int = 0,
    param_bytes: int = GRAD_BYTES,
    trained: list[bool] | None = None,
    grad_bytes: int = GRAD_BYTES,
) -> dict[str, int]:
    """Bytes per rank per step by kind (the module docstring); stage 3: ``uses`` gathers of
    each tensor per step (default: twice per microbatch) and ``votes`` agreement all-reduces.
    ``trained``: per tensor, whether it trains (default all); only those are reduced and, in
    stages 1-2, partitioned; stage 3 gathers every tensor, frozen ones too."""
    n = w.world
    if n == 1:
        return {}
    m = w.microbatches
    warm = tensors if trained is None else [k for k, t in zip(tensors, trained) if t]
    grads = sum(warm) * grad_bytes
    small = all_reduce(8 * (len(warm) + 1), n) + sum(all_reduce(b, n) for b in ZERO_STEP_SCALARS[stage])
    # the flat fp32 partitions of stages 1-2 are padded to a multiple of 2n elements
    # (DeepSpeed's nccl_start_alignment_factor = 2): each rank gathers its padded share
    flat = (n - 1) * -(-sum(warm) // (2 * n)) * 2 * param_bytes
    if stage == 1:
        return {"all_reduce": all_reduce(grads, n) + small, "all_gather": flat}
    if stage == 2:
        return {"all_reduce": m * all_reduce(grads, n) + small, "all_gather": flat}
    uses = [2 * m] * len(tensors) if uses is None else uses
    shard = [(n - 1) * -(-k // n) for k in tensors]
    persistent = sum(s for s, k in zip(shard, tensors) if k <= persistence_threshold)
    gathered = sum(u * s for u, s, k in zip(uses, shard, tensors) if k > persistence_threshold)
    return {
        "all_gather": (gathered + persistent) * param_bytes,
        "reduce_scatter": m * sum((n - 1) * -(-k // n) for k in warm) * grad_bytes,
        "all_reduce": small + votes * all_reduce(VOTE_BYTES, n),
    }


def zero_calls(
    tensors: list[ParamTensor],
    stage: int,
    w: Workload,
    bucket: int = DEEPSPEED_BUCKET,
    persistence_threshold: int = DEEPSPEED_PERSISTENCE,
    uses: list[int] | None = None,
    votes: int = 0,
    trained: list[bool] | None = None,
) -> dict[str, int]:
    """DeepSpeed's collectives, as :func:`zero_comm` sums their bytes (``trained`` as there), in buckets of
    ``bucket`` elements (``B = ceil(P / bucket)`` calls per reduction): stage 1
    all-reduces gradients once per step (``B``), stage 2 in every backward
    (``M·B``), both all-gather the updated partitions (``B``); stage 3 gathers one module's
    partitioned tensors per call, ``uses`` times per step (a module's tensors share its
    count), plus the persistent ones once after the step, and reduce-scatters in every
    backward (``M·B``). Every stage: ``zero``'s agreement all-reduce and DeepSpeed's two
    scalar all-reduces (3), and stage 3's ``votes``."""
    if w.world == 1:
        return {}
    numel = sum(t.numel for i, t in enumerate(tensors) if trained is None or trained[i])
    buckets = max(1, -(-numel // bucket))
    small = 3
    if stage == 3:
        uses = [2 * w.microbatches] * len(tensors) if uses is None else uses
        persistent = sum(t.numel <= persistence_threshold for t in tensors)
        per_module: dict[str, int] = {}
        for t, u in zip(tensors, uses):
            if t.numel > persistence_threshold:
                per_module[module_of(t.name)] = u
        gathers = sum(per_module.values()) + persistent
        return {
            "all_gather": gathers,
            "reduce_scatter": w.microbatches * buckets,
            "all_reduce": small + votes,
        }
    reductions = buckets if stage == 1 else w.microbatches * buckets
    return {"all_reduce": reductions + small, "all_gather": buckets}


def module_of(name: str) -> str:
    """The submodule a parameter belongs to (DeepSpeed gathers per submodule)."""
    return name.rsplit(".", 1)[0] if "." in name else ""


_LAYER = re.compile(r"(^|\.)(layers|blocks)\.\d+\.")


def in_module_order(tensors: list[ParamTensor], tr: Any) -> list[ParamTensor]:
    """Every tensor DeepSpeed holds (``tensors``, then each LoRA adapter after its base
    linear's last tensor, as PEFT's wrapped module lists them): what stage 3 gathers."""
    if tr.full:
        return list(tensors)
    extra: dict[str, list[ParamTensor]] = {}
    for a in tr.adapters:
        extra.setdefault(a.name.rsplit(".", 2)[0], []).append(a)
    last = {module_of(t.name): i for i, t in enumerate(tensors)}
    out: list[ParamTensor] = []
    for i, t in enumerate(tensors):
        out.append(t)
        here = module_of(t.name)
        if last[here] == i:
            out += extra.get(here, [])
    return out


def zero3_uses(tensors: list[ParamTensor], w: Workload, encoder: bool, chunks: int) -> tuple[list[int], int]:
    """Per tensor, how many times stage 3 gathers it per step when nothing is kept for reuse,
    and the agreement all-reduces per step (the module docstring). Every rank runs the
    busiest rank's passes (placeholders), so per microbatch ``p = ceil(samples / (m·replicas))``
    samples: an encoder's ``p`` root calls (one per sample), the LLM's one forward with
    ``chunks`` loss chunks."""
    m = w.microbatches
    per_mb = -(-w.samples // (m * w.replicas))
    passes = per_mb if encoder else 1
    head = "embed_tokens.weight" if not any(t.name == "lm_head.weight" for t in tensors) else "lm_head.weight"
    # the encoder's first module reads the data, which needs no gradient: DeepSpeed's
    # post-backward hook never fires for it, so it stays gathered from its first backward
    # fetch to the end of that backward (one backward fetch per microbatch, not per pass)
    first = module_of(tensors[0].name) if encoder and tensors else None
    out = []
    for t in tensors:
        if module_of(t.name) == first:
            out.append(m * (passes + 1))
            continue
        # forward and backward; a replayed layer (full recompute) or loss chunk gathers in its
        # replay what the backward then uses without a second gather (runtime.keep_replayed)
        u = 2
        if not encoder and t.name == head:
            # the chunked loss's head: twice per chunk (a tied embedding is also the input
            # embedding: its own two on top)
            u = 2 * chunks + (2 if head == "embed_tokens.weight" else 0)
        out.append(m * passes * u)
    votes = m * (passes + 1 if encoder else 2)
    return out, votes


def zero_state_bytes(
    numels: list[int],
    stage: int,
    n: int,
    persistence_threshold: int = DEEPSPEED_PERSISTENCE,
    frozen: list[int] = (),  # type: ignore[assignment]
    precision: str = "fp32",
) -> int:
    """DeepSpeed's holdings after a step under the ``train.precision`` recipe ``precision``
    (the module docstring's table); ``frozen``: the elements of each frozen tensor (LoRA's
    base), which hold their weight only (whole in stages 1-2, partitioned in stage 3: no
    master, gradient or moments)."""
    w, master, grad, moments = ds_bytes(precision)
    psi = sum(numels)
    cold = list(frozen)
    if stage < 3:
        # BF16_Optimizer (stage 1 under bf16) keeps the whole fp32 gradient between steps
        kept = grad * psi if stage == 1 and precision == "bf16" else 0
        return w * (psi + sum(cold)) + (master + moments) * -(-psi // n) + kept
    parts = sum(-(-k // n) for k in numels)
    whole = sum(k for k in [*numels, *cold] if k <= persistence_threshold)
    return (w + master + grad + moments) * parts + w * sum(-(-k // n) for k in cold) + w * whole


def ds_bytes(precision: str) -> tuple[int, int, int, int]:
    """Bytes per element of what DeepSpeed holds under a recipe (``dsconfig.PRECISION_SECTIONS``):
    the module's weight, its master partition (a copy even where it has the weight's dtype),
    the gradient as accumulated and reduced, and AdamW's two moments together."""
    r = RECIPES[precision]
    master = r.master or r.weights
    return r.weights.itemsize, master.itemsize, r.grads.itemsize, 2 * r.moments.itemsize


def zero_buffer_bytes(stage: int, bucket: int, grad_bytes: int, trains: bool = True) -> int:
    """Stage 3's reduce bucket (the module docstring): ``bucket`` elements
    (:func:`disagg_zero.dsconfig.reduce_bucket_elements`) in the gradients' reduction dtype of
    ``grad_bytes``; none for a frozen module (DeepSpeed builds no ZeRO-3 optimizer for it)."""
    return bucket * grad_bytes if stage == 3 and trains else 0


def zero_gathered_bytes(
    tensors: list[ParamTensor],
    stage: int,
    persistence_threshold: int = DEEPSPEED_PERSISTENCE,
    prefetch: int = DEEPSPEED_PREFETCH,
    max_live: int = DEEPSPEED_MAX_LIVE,
    reuse: int = DEEPSPEED_REUSE,
    param_bytes: int = GRAD_BYTES,
    encoder: bool = False,
    recompute_full: bool = False,
) -> int:
    """Stage 3: the parameters DeepSpeed's per-submodule gathering holds whole at once on top
    of the state (the module docstring): the largest module's own partitioned tensors (under
    full recompute, or the largest layer's: its replay gathers them all for its backward); with
    prefetch on, what it fetches ahead, up to ``max_live`` elements (each fetch adds whole
    tensors until the bucket is full, so it may pass the limit by one tensor); what it keeps
    for reuse (``reuse`` elements); an encoder's first module (fed by data, so DeepSpeed's
    post-backward release never fires for it: it stays gathered to the end of a microbatch's
    backward); at most every partitioned tensor."""
    if stage < 3:
        return 0
    per_module: dict[str, int] = {}
    per_layer: dict[str, int] = {}
    for t in tensors:
        if t.numel > persistence_threshold:
            per_module[module_of(t.name)] = per_module.get(module_of(t.name), 0) + t.numel
            layer = _LAYER.search(t.name)
            if recompute_full and layer:
                key = t.name[: layer.end()]
                per_layer[key] = per_layer.get(key, 0) + t.numel
    if not per_module:
        return 0
    # a replayed layer holds all its tensors from its replay to their backward
    held = max([*per_module.values(), *per_layer.values()]) + reuse
    if prefetch > 0:
        held += max_live + max(t.numel for t in tensors if t.numel > persistence_threshold)
    if encoder and tensors:
        held += per_module.get(module_of(tensors[0].name), 0)
    return param_bytes * min(sum(per_module.values()), held)


def estimate(
    query: CostQuery,
    stage: int,
    persistence_threshold: int = DEEPSPEED_PERSISTENCE,
    recompute: str = "none",
    offload_optimizer: bool = False,
    chunk: int | None = DEFAULT_CHUNK_TOKENS,
    gather: dict[str, int] | None = None,
    reduce_bucket: int = DEEPSPEED_BUCKET,
) -> Cost:
    """``recompute``: the strategy's own option, used where the query names none;
    ``offload_optimizer`` keeps the fp32 master partition and the two moments
    (12 bytes per element, partitioned) off the GPU; ``chunk``: the LLM's
    ``loss_chunk_tokens`` (logits of one chunk held at once; None: the whole microbatch's);
    ``gather``: stage 3's ``prefetch``, ``max_live`` and ``reuse`` elements (DeepSpeed's
    defaults where unset); ``reduce_bucket``: the elements of stage 3's reduce bucket
    (:func:`zero_buffer_bytes`)."""
    if recompute != "none" and not query.recompute:
        query = replace(query, recompute=recompute)
    mode = recompute_mode(query.recompute)
    w = workload_of(query)
    shape = query.shape
    tr = query_trained(query)
    tensors = in_module_order(shape.tensors(), tr)
    warm = {t.name for t in tr.trainable}
    trained = [t.name in warm for t in tensors]
    numels = [t.numel for t in tensors]
    tokens = held_tokens(query, w)
    act = replica_activation_bytes(shape, mode, tokens, w.act_bytes, chunk)
    if mode != "full":  # under full recompute a block's adapters save only while it replays
        act += cost_training.adapter_activation_bytes(tr, tokens, w.act_bytes)
    work = train_flops(shape, query.seq_len) + cost_training.flops_delta(tr, query.seq_len)
    work += extra_flops(shape, query.seq_len, work, mode)
    base = strategy_compute(shape, query.seq_len, Split(), w.act_bytes, "none")
    compute = cost_training.compute_delta(base, tr, query.seq_len, Split()).with_recompute(mode)
    uses, votes = None, 0
    if stage == 3:
        per_mb_tokens = -(-w.samples // (w.microbatches * w.replicas)) * w.seq_len
        chunks = -(-per_mb_tokens // chunk) if chunk else 1
        uses, votes = zero3_uses(tensors, w, bool(query.encoder), max(1, chunks))
    weight = w.recipe.weights.itemsize
    cost = assemble(
        w,
        state_bytes=zero_state_bytes(
            [t.numel for t in tr.trainable],
            stage,
            w.world,
            persistence_threshold,
            [t.numel for t in tr.frozen],
            w.precision,
        ),
        activation_bytes=act,
        comm=zero_comm(numels, stage, w, persistence_threshold, uses, votes, weight, trained, w.grad_bytes),
        calls=zero_calls(
            tensors,
            stage,
            w,
            persistence_threshold=persistence_threshold,
            uses=uses,
            votes=votes,
            trained=trained,
        ),
        flops_per_sample=work,
        share=1,
        sent_bytes=transfer_bytes(w),
        compute=compute,
    )
    knobs = gather or {}
    held = zero_gathered_bytes(
        tensors,
        stage,
        persistence_threshold,
        knobs.get("prefetch", DEEPSPEED_PREFETCH),
        knobs.get("max_live", DEEPSPEED_MAX_LIVE),
        knobs.get("reuse", DEEPSPEED_REUSE),
        weight,
        encoder=bool(query.encoder),
        recompute_full=mode == "full",
    )
    buffers = zero_buffer_bytes(stage, reduce_bucket, w.grad_bytes, bool(tr.trainable))
    cost = replace(cost, gathered_bytes=held, buffer_bytes=buffers)
    if offload_optimizer:
        numel = sum(t.numel for t in tr.trainable)
        _, master, _, moments = ds_bytes(w.precision)
        moved = (master + moments) * -(-numel // w.world)
        cost = replace(cost, state_bytes=cost.state_bytes - moved, host_bytes=moved)
    return cost
