"""``megatron_tp``'s cost, with or without sequence parallelism: each rank of a
degree-``d`` group holds ``1/d`` of the column / row / vocabulary-parallel
weights and the rest whole, and every sample's whole sequence.

Exact (equal to what :class:`disagg.interfaces.CommCounter` and
``Strategy.state_bytes`` count): state bytes, and an encoder's communication
without sequence parallelism; saved activations of a Qwen2.5-VL tower in fp32.
With sequence parallelism and for a decoder, communication is an estimate.

Notation: ``W = degree x replicas`` ranks; a replica gets ``s = ceil(samples /
replicas)`` samples of ``N`` tokens; ``e`` bytes per activation element;
gradients in the recipe's gradient dtype (4 bytes but under ``bf16-pure``); ``H``
hidden, ``I`` MLP width, ``O`` the merger's output width, ``U`` tokens per merged row, ``L`` blocks / layers.
"""

from __future__ import annotations

from typing import Any

from disagg.interfaces.compute import Split
from disagg.interfaces.cost import Cost, CostQuery, DecoderShape, EncoderShape, ParamTensor, Shape, Workload
from disagg.interfaces.strategy import DEFAULT_CHUNK_TOKENS
from disagg.kit.cost import tiled_mlp as cost_tiles
from disagg.kit.cost import training as cost_training
from disagg.kit.cost.assemble import assemble, held_tokens, workload
from disagg.kit.cost.gemms import strategy_compute
from disagg.kit.cost.rules import activation_bytes as whole_activation_bytes
from disagg.kit.cost.rules import (
    all_reduce,
    blocks_of,
    extra_flops,
    fp32_internal_bytes,
    logits_bytes,
    recompute_mode,
    train_flops,
    transfer_bytes,
    with_peaks,
    with_recompute,
)
from disagg.kit.cost.training import query_trained
from disagg.kit.sharding.cost import with_offload

#: searched by ``disagg plan`` beside the defaults
OPTION_VARIANTS: list[dict[str, Any]] = [{}, {"sequence_parallel": True}]


# -- bytes ---------------------------------------------------------------------------------------
def encoder_comm(
    shape: EncoderShape, w: Workload, sequence_parallel: bool, tr: cost_training.Trained | None = None
) -> dict[str, int]:
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
        partial = [t.numel for t in _warm(shape, tr) if t.tp == "replicated" and "patch_embed" not in t.name]
        out["all_reduce"] += all_reduce(w.grad_bytes * sum(partial), w.world)
    if d > 1:
        out["broadcast"] = s * rows * shape.out_hidden * e
    out["all_reduce"] = out.get("all_reduce", 0) + _grad_reduce(_warm(shape, tr), w)
    _add(out, _adapter_comm(tr, w, n, sequence_parallel))
    return out


def _warm(shape: Shape, tr: cost_training.Trained | None) -> list[ParamTensor]:
    """The tensors that train (all of them without LoRA or frozen parts)."""
    return shape.tensors() if tr is None else list(tr.trainable)


def _add(out: dict[str, int], extra: dict[str, int]) -> None:
    for k, v in extra.items():
        out[k] = out.get(k, 0) + v


def _adapter_comm(
    tr: cost_training.Trained | None, w: Workload, n: int, sequence_parallel: bool
) -> dict[str, int]:
    """LoRA's own collectives per sample (``disagg_llm_tp.lora``): a column adapter's ``lora_B``
    all-reduces its input gradient, a row adapter's ``lora_A`` its output (``r`` wide; under
    sequence parallelism a reduce-scatter of the ``r``-wide rows, an estimate)."""
    if tr is None or not tr.adapters or w.degree == 1:
        return {}
    sites = cost_training.adapter_sites(tr)
    r = tr.adapters[0].shape[0]
    rows = n * r * w.act_bytes
    s = w.samples_per_replica
    if sequence_parallel:
        shard = (w.degree - 1) * -(-n // w.degree) * r * w.act_bytes
        return {
            "all_reduce": s * sites["column"] * all_reduce(rows, w.degree),
            "reduce_scatter": s * sites["row"] * shard,
        }
    return {"all_reduce": s * (sites["column"] + sites["row"]) * all_reduce(rows, w.degree)}


def decoder_comm(
    shape: DecoderShape,
    w: Workload,
    sequence_parallel: bool,
    tr: cost_training.Trained | None = None,
    chunk: int | None = DEFAULT_CHUNK_TOKENS,
) -> dict[str, int]:
    """Per layer and sample of ``N`` tokens: q, k, v, gate, up all-reduce their input
    gradient, o and down their output (``7 · ar(N·H·e)``); the vocabulary-parallel
    embedding all-reduces its output and the output layer its input gradient; the
    vocabulary-parallel cross entropy all-reduces three fp32 values per row of the shifted
    hidden states (``N - 1`` per sample) in each loss chunk, and again when a chunk is replayed
    in backward (:func:`loss_chunks`). With sequence parallelism the layer all-reduces become
    ``6·L + 2`` all-gathers and ``4·L + 1`` reduce-scatters of ``ceil(N/d)`` tokens (under the
    chunked loss the output layer's input is gathered once and kept whole, so no backward
    re-gather: ``6·L + 3`` without it). Exact with sequence parallelism, one sample per
    microbatch and every token needing a gradient; otherwise an estimate."""
    d, s, n = w.degree, w.samples_per_replica, w.seq_len
    h, e = shape.hidden, w.act_bytes
    out: dict[str, int] = {}
    per = all_reduce(n * h * e, d)
    partial = 0
    if not sequence_parallel:
        per += (7 * shape.layers + 1) * all_reduce(n * h * e, d)
    else:
        c = -(-n // d)
        shard = (d - 1) * c * h * e
        out["all_gather"] = s * (6 * shape.layers + (2 if chunk else 3)) * shard
        out["reduce_scatter"] = s * (4 * shape.layers + 1) * shard
        norms = [t.numel for t in _warm(shape, tr) if t.tp == "replicated"]
        partial = all_reduce(w.grad_bytes * sum(norms), w.world)
    per_mb = -(-s // w.microbatches)
    ce = 0
    if d > 1:
        chunks = loss_chunks(per_mb * (n - 1), chunk)
        ce = (2 if len(chunks) > 1 else 1) * sum(3 * all_reduce(4 * r, d) for r in chunks)
    out["all_reduce"] = s * per + -(-s // per_mb) * ce + partial + _grad_reduce(_warm(shape, tr), w)
    _add(out, _adapter_comm(tr, w, n, sequence_parallel))
    return out


def loss_chunks(rows: int, chunk: int | None) -> list[int]:
    """Rows of each loss chunk over ``rows`` shifted hidden states (core's chunked loss,
    ``parallel.llm.loss_chunk_tokens``); one chunk of all of them without it. With several
    chunks each is checkpointed: its head and loss run again in backward."""
    if not chunk or rows <= chunk:
        return [rows]
    k, rest = divmod(rows, chunk)
    return [chunk] * k + ([rest] if rest else [])


def _grad_reduce(tensors: list[ParamTensor], w: Workload) -> int:
    """``agree_on_grads`` over the group (one int32 per tensor), replicas sum
    their local gradients (one flat buffer), the global grad norm is one float64
    scalar all-reduced over the group."""
    agree = all_reduce(4 * len(tensors), w.world)
    dp = all_reduce(w.grad_bytes * sum(t.local_numel(w.degree) for t in tensors), w.replicas)
    return agree + dp + all_reduce(8, w.world)


# -- calls ---------------------------------------------------------------------------------------
def _grad_calls(w: Workload) -> dict[str, int]:
    """The reduction: ``agree_on_grads`` and the global-norm scalar over the group,
    one flat all-reduce over replicas when there are several."""
    if w.world == 1:
        return {}
    return {"all_reduce": 2 + (1 if w.replicas > 1 else 0)}


def encoder_calls(shape: EncoderShape, w: Workload, sequence_parallel: bool) -> dict[str, int]:
    """Per image (an encoder's samples are encoded one by one), as :func:`encoder_comm`
    sums bytes: without sequence parallelism ``5·L + 2`` all-reduces; with it
    ``6·L + 3`` all-gathers, ``4·L + 1`` reduce-scatters and the merger's all-reduce;
    shard 0's broadcast of the output gradient. Once per step: the gradient reduction
    (and, with sequence parallelism, the partial norms' all-reduce)."""
    d, m = w.degree, max(w.samples_per_replica, w.microbatches)
    out = _grad_calls(w)
    if d > 1:
        if sequence_parallel:
            out["all_gather"] = m * (6 * shape.depth + 3)
            out["reduce_scatter"] = m * (4 * shape.depth + 1)
            out["all_reduce"] = out.get("all_reduce", 0) + m + 1
        else:
            out["all_reduce"] = out.get("all_reduce", 0) + m * (5 * shape.depth + 2)
        out["broadcast"] = m
    return out


def decoder_calls(
    shape: DecoderShape, w: Workload, sequence_parallel: bool, chunk: int | None = DEFAULT_CHUNK_TOKENS
) -> dict[str, int]:
    """Per microbatch, as :func:`decoder_comm` sums bytes: the vocabulary-parallel
    embedding's output all-reduce, the cross entropy's three (max, sum of
    exponentials, target logit) per loss chunk (twice per chunk when there are several:
    each is replayed in backward), and without sequence parallelism ``7·L + 1``
    layer all-reduces (with it ``6·L + 2`` all-gathers, ``6·L + 3`` without the chunked
    loss, and ``4·L + 1`` reduce-scatters, and one all-reduce of the norms' partial
    gradients per step)."""
    d, m = w.degree, w.microbatches
    out = _grad_calls(w)
    if d > 1:
        per_mb = -(-w.samples_per_replica // m)
        chunks = len(loss_chunks(per_mb * (w.seq_len - 1), chunk))
        per = 1 + 3 * chunks * (2 if chunks > 1 else 1)
        if sequence_parallel:
            out["all_gather"] = m * (6 * shape.layers + (2 if chunk else 3))
            out["reduce_scatter"] = m * (4 * shape.layers + 1)
            out["all_reduce"] = out.get("all_reduce", 0) + 1
        else:
            per += 7 * shape.layers + 1
        out["all_reduce"] = out.get("all_reduce", 0) + m * per
    return out


# -- saved activations ---------------------------------------------------------------------------
def activation_bytes(
    shape: Shape,
    tokens: int,
    degree: int,
    act_bytes: int,
    sequence_parallel: bool,
    chunk: int | None = DEFAULT_CHUNK_TOKENS,
    samples: int = 1,
    rows_in: bool = False,
    tiles: int | str = 1,
) -> int:
    """Saved bytes on one rank for ``tokens`` tokens (of ``samples`` sequences; ``rows_in``:
    encoder rows are scattered into the decoder's embeddings): the column outputs and what
    follows them are split ``1/d``, the rest is a full replica; sequence parallelism
    also splits the norms and saves the column inputs as shards
    (:func:`sp_decoder_activation_bytes`, exact for a decoder). A decoder's logits:
    ``1/d`` of the vocabulary for one loss chunk (``chunk`` tokens). ``tiles``: ``mlp_tiles``
    (:func:`tiled_mlp_saves`)."""
    d = degree
    if d == 1:
        return whole_activation_bytes(shape, tokens, act_bytes, chunk, tiles)
    h, i, hd, heads = shape.hidden, shape.intermediate, shape.head_dim, shape.heads
    mlp = tiled_mlp_saves(shape, tokens, d, sequence_parallel, tiles)
    if isinstance(shape, EncoderShape):
        mlp_in, mlp_mid = shape.mlp_in, shape.mlp_mid
        if sequence_parallel:
            block_tp = ((12 + mlp_in) * h + heads + 4 + mlp_mid * i) / d + 4 * hd
            merger_tp = (4 * h + 2) / d + 2 * h / d
        else:
            block_tp = (7 + mlp_in) * h + 4 + 4 * hd + (5 * h + heads + mlp_mid * i) / d
            merger_tp = 4 * h + 2 + 2 * h / d
        per_token = shape.input_elems + shape.depth * block_tp + merger_tp
        norm_tokens = tokens / d if sequence_parallel else tokens
        extra = fp32_internal_bytes(shape, norm_tokens, tokens, act_bytes)
        tiled = shape.depth * (mlp.held - mlp.whole) + mlp.peak
        return int((tokens * per_token + tiled) * act_bytes) + shape.window_index_bytes(tokens) + extra
    if sequence_parallel:
        return sp_decoder_activation_bytes(shape, tokens, d, act_bytes, chunk, samples, rows_in, tiles)
    layer = 9 * h + 4 + 4 * hd + (5 * h + heads + 4 * i) / d
    head = 4 * h
    logits = logits_bytes(-(-shape.vocab // d), tokens, chunk)  # this rank's vocabulary slice
    extra = fp32_internal_bytes(shape, tokens, 0, act_bytes)
    held = tokens * (shape.layers * layer + head) + shape.layers * (mlp.held - mlp.whole)
    return int(held * act_bytes) + with_peaks(logits, int(mlp.peak * act_bytes), tokens, chunk) + extra


def tiled_mlp_saves(
    shape: Shape, tokens: int, degree: int, sequence_parallel: bool, tiles: int | str
) -> cost_tiles.MLPSaves:
    """One block's MLP saves (elements) on a rank of degree ``d`` for ``tokens`` tokens, without
    and with ``mlp_tiles`` (:mod:`disagg.kit.cost.tiled_mlp`): its intermediates are ``I/d`` wide;
    without sequence parallelism it reads all the tokens; with it this rank's ``c = ceil(T/d)``
    rows, whose inputs it saves as a shard, and each tile gathers ``d x`` its rows (the untiled
    intermediates are on the ``T`` tokens the norm's gather keeps, a tile's on every rank's rows,
    the last one's padding included)."""
    d = degree
    mid = shape.intermediate // d
    if not sequence_parallel or d == 1:
        return cost_tiles.saves(shape, tokens, tiles, mid)
    c = -(-tokens // d)
    got = cost_tiles.saves(shape, c, tiles, mid, gather=d)
    _, mlp_mid = cost_tiles.mlp_widths(shape)
    whole = got.whole - mlp_mid * mid * (d * c - tokens)  # the gather cut the padding rows
    held = got.held if cost_tiles.enabled(tiles) else whole
    return cost_tiles.MLPSaves(whole, held, got.peak)


def sp_decoder_activation_bytes(
    shape: DecoderShape,
    tokens: int,
    degree: int,
    e: int,
    chunk: int | None = DEFAULT_CHUNK_TOKENS,
    samples: int = 1,
    rows_in: bool = False,
    tiles: int | str = 1,
) -> int:
    """Saved bytes of a decoder under sequence parallelism on the busiest rank, for ``tokens``
    tokens of ``samples`` sequences, as the hooks count them (HF's Qwen2/Llama code, megatron_tp's
    layers, core's chunked loss): per layer, on this rank's ``c = ceil(T/d)`` tokens at full width
    the two RMSNorms (input twice, rsqrt twice, output: ``2·(3H + 2)``) and the five column
    linears' inputs (``5H``, gathered again in backward); on all ``T`` tokens at the local width
    rotary's cos/sin (``4·hd``), q and the attention output (``2·H/d``), this rank's key/value
    heads (``2·kv``), the log-sum-exp (``heads/d``), o_proj's input (``H/d``) and the SwiGLU MLP
    (``4·I/d``); the final norm (``3H + 2`` on ``c``); the vocabulary-parallel embedding's masks
    (10 bytes per token: int64 ids, two bools; 1 more with encoder rows scattered in,
    ``rows_in``). The loss over ``R = T - samples`` shifted rows: one chunk keeps the output
    layer's whole input (``R·H``), this rank's fp32 logits (``4·R·ceil(V/d)`` bytes), 10 bytes
    per row of masks and targets, the padded vocabulary's mask where ``V % d``, and the loss
    sum's 12 bytes per row + 4; several chunks keep each chunk's input and int64 targets and
    the loss sum, and one chunk's saves while it is replayed (the peak). Exact in fp32.

    With ``tiles`` (``mlp_tiles``, :func:`tiled_mlp_saves`): per layer the MLP keeps its input
    shard (``H`` on ``c``) instead of the gate/up inputs (``2H`` on ``c``) and the ``4·I/d`` on ``T``;
    one tile's replay (its gathered input twice and its ``4·I/d`` on ``d x ceil(c / tiles)`` rows)
    is a peak, never at once with a loss chunk's replay (the larger of the two)."""
    d = degree
    h, i, hd = shape.hidden, shape.intermediate, shape.head_dim
    kv_heads = shape.kv_heads
    kv = (kv_heads // d if kv_heads % d == 0 else 1) * hd
    c, t = -(-tokens // d), tokens
    layer = c * (11 * h + 4) + t * ((3 * h + shape.heads + 4 * i) // d + 2 * kv + 4 * hd)
    mlp = tiled_mlp_saves(shape, tokens, d, True, tiles)
    layer += mlp.held - mlp.whole
    tile = int(e * mlp.peak)
    floats = shape.layers * layer + c * (3 * h + 2)
    held = e * floats + 10 * t + (t if rows_in else 0) + fp32_internal_bytes(shape, c, 0, e)
    rows = tokens - samples
    vocab = -(-shape.vocab // d)
    pad = vocab if shape.vocab % d else 0
    chunks = loss_chunks(rows, chunk)

    def replayed(r: int) -> int:  # one chunk's head input, logits, masks and targets
        return e * r * h + 4 * r * vocab + 10 * r + pad

    total = 12 * rows + 4
    if len(chunks) == 1:
        return held + replayed(rows) + total + tile
    return held + sum(e * r * h + 8 * r for r in chunks) + total + max(replayed(chunks[0]), tile)


def replay(
    shape: Shape, w: Workload, sequence_parallel: bool, mode: str
) -> tuple[dict[str, int], dict[str, int]]:
    """A ``full`` replay runs the blocks' forward collectives again: the row outputs'
    all-reduces (with sequence parallelism their reduce-scatters and the two norm gathers;
    the replay keeps the column inputs as shards, so the backward re-gathers them as
    without recompute)."""
    if mode != "full" or w.degree == 1:
        return {}, {}
    s, m, e, h = w.samples_per_replica, w.microbatches, w.act_bytes, shape.hidden
    blocks, n = blocks_of(shape), w.seq_len
    if isinstance(shape, EncoderShape):
        m = max(s, m)  # an encoder's samples are encoded one by one (encoder_calls)
    if sequence_parallel:
        shard = (w.degree - 1) * -(-n // w.degree) * h * e
        nbytes, calls = s * 2 * blocks * shard, 2 * blocks * m
        kinds = ("reduce_scatter", "all_gather")
        return dict.fromkeys(kinds, nbytes), dict.fromkeys(kinds, calls)
    return {"all_reduce": s * 2 * blocks * all_reduce(n * h * e, w.degree)}, {"all_reduce": 2 * blocks * m}


def tile_comm(
    shape: Shape, w: Workload, sequence_parallel: bool, mode: str, tiles: int | str
) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes and calls per step ``mlp_tiles`` adds (:mod:`disagg.kit.recompute.tiled_mlp`), per
    block and forward of ``N`` tiles. Each tile's replay runs the MLP's forward collectives once
    more: without sequence parallelism the down projection's all-reduce (``ar(n·H·e)`` per sample),
    the column linears' input-gradient all-reduces split per tile (``4N`` calls for the untiled 3;
    ``5N`` for 4 under ``full``); with it the down projection's reduce-scatter (the tile's gather
    replaces the untiled backward's re-gather of the saved shard, under ``full`` too, whose replay
    keeps shards): ``3N`` all-gathers and ``3N`` reduce-scatters for the untiled 3 and 2 (``4N``
    and ``4N`` for 4 and 3 under ``full``), each of ``(d-1)·ceil(n/d)·H·e`` bytes in all per
    sample."""
    d = w.degree
    if not cost_tiles.enabled(tiles) or d == 1:
        return {}, {}
    s, n, e, h = w.samples_per_replica, w.seq_len, w.act_bytes, shape.hidden
    blocks = blocks_of(shape)
    enc = isinstance(shape, EncoderShape)
    m = max(s, w.microbatches) if enc else w.microbatches  # forwards (an encoder's: one per sample)
    rows = n if enc else -(-s // w.microbatches) * n  # rows of one forward
    full = mode == "full"
    if sequence_parallel:
        c = -(-rows // d)
        k = cost_tiles.tile_count(tiles, c, h, d)
        shard = (d - 1) * -(-n // d) * h * e
        nbytes = {"reduce_scatter": s * blocks * shard}
        calls = {"reduce_scatter": m * blocks * ((4 * k - 3) if full else (3 * k - 2))}
        calls["all_gather"] = m * blocks * ((4 * k - 4) if full else (3 * k - 3))
        return nbytes, calls
    k = cost_tiles.tile_count(tiles, rows, h)
    return (
        {"all_reduce": s * blocks * all_reduce(n * h * e, d)},
        {"all_reduce": m * blocks * ((5 * k - 4) if full else (4 * k - 3))},
    )


def estimate(
    query: CostQuery,
    sequence_parallel: bool,
    chunk: int | None = DEFAULT_CHUNK_TOKENS,
    offload: bool = False,
    tiles: int | str = 1,
) -> Cost:
    """``tiles``: ``parallel.<module>.mlp_tiles`` (saves :func:`tiled_mlp_saves`, collectives
    :func:`tile_comm`, one more forward of the MLPs)."""
    if query.context_parallel > 1:  # TP x CP: TP's own cost on 1/N of the tokens, plus the K/V exchange
        from disagg.kit.context_parallel.cost import with_context_parallel

        cost = with_context_parallel(lambda q: estimate(q, sequence_parallel, chunk, offload, tiles), query)
        assert cost is not None
        return cost
    shape, sp = query.shape, sequence_parallel
    mode = recompute_mode(query.recompute)
    w = workload(query)
    d = w.degree
    enc = isinstance(shape, EncoderShape)
    tr = query_trained(query)
    comm = encoder_comm(shape, w, sp, tr) if enc else decoder_comm(shape, w, sp, tr, chunk)  # type: ignore[arg-type]
    calls = encoder_calls(shape, w, sp) if enc else decoder_calls(shape, w, sp, chunk)  # type: ignore[arg-type]
    if tr.adapters and d > 1:  # one call per adapter and forward (microbatch; an encoder's image)
        sites = cost_training.adapter_sites(tr)
        m = max(w.samples_per_replica, w.microbatches) if enc else w.microbatches
        kinds = (
            {"all_reduce": sites["column"], "reduce_scatter": sites["row"]}
            if sp
            else {"all_reduce": sites["column"] + sites["row"]}
        )
        _add(calls, {k: m * v for k, v in kinds.items() if v})
    tiled_bytes, tiled_calls = tile_comm(shape, w, sp, mode, tiles)
    _add(comm, tiled_bytes)
    _add(calls, tiled_calls)
    tokens = held_tokens(query, w)
    held_samples, rows_in = max(1, tokens // max(w.seq_len, 1)), w.exchanged_rows > 0
    act = with_recompute(
        shape,
        mode,
        activation_bytes(shape, tokens, d, w.act_bytes, sp, chunk, held_samples, rows_in, tiles),
        w.act_bytes,
        full_held=-(-tokens // d) if sp else tokens,
        selective_held=tokens,
        layer_bytes=lambda one: activation_bytes(
            one, tokens, d, w.act_bytes, sp, chunk, held_samples, rows_in, tiles
        ),
    )
    if mode != "full":  # under full recompute a block's adapters save only while it replays
        act += cost_training.adapter_activation_bytes(tr, tokens, w.act_bytes)
    work = train_flops(shape, query.seq_len) + cost_training.flops_delta(tr, query.seq_len)
    work += extra_flops(shape, query.seq_len, work, mode) + cost_tiles.replay_flops(
        shape, query.seq_len, tiles
    )
    split = Split(tp=d, sequence_parallel=sp)
    base = strategy_compute(shape, query.seq_len, split, w.act_bytes, "none")
    cost = assemble(
        w,
        state_bytes=cost_training.state_bytes(tr, d, w.state_element, w.weight_bytes),
        activation_bytes=act,
        comm=comm,
        calls=calls,
        flops_per_sample=work,
        share=d,
        sent_bytes=transfer_bytes(w),
        # every token through 1/d of each split weight; without sequence parallelism the norms and
        # residual adds are repeated on every rank for all tokens
        compute=cost_tiles.replay_compute(
            cost_training.compute_delta(base, tr, query.seq_len, split).with_recompute(mode),
            shape,
            query.seq_len,
            split,
            tiles,
        ),
        # with LoRA an encoder's activation collectives depend on which inputs need a gradient
        exact=("state_bytes", "comm_bytes") if enc and not sp and tr.full else ("state_bytes",),
        replay=replay(shape, w, sp, mode),
    )
    if not offload:  # offload: optimizer (disagg.kit.offload): masters, sums, moments on the host
        return cost
    held = sum(t.local_numel(d) for t in tr.trainable)
    return with_offload(cost, held, len(tr.trainable), "none", w.recipe)
