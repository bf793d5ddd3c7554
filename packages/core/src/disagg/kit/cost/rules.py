"""The formulas strategies share when they state their cost (:mod:`disagg.interfaces.cost`).

**Bytes** are counted as :class:`disagg.interfaces.CommCounter` counts them
(textbook ring algorithms, what one rank *sends*): all-reduce of ``b`` bytes
over ``n`` ranks sends ``2(n-1)b/n`` (floored per call), all-gather /
reduce-scatter of shards of ``b`` bytes send ``(n-1)b``, an all-to-all sends
everything but its own chunk, a broadcast is counted on its source. Gradients
reduced by the base class go in 25 MiB buckets (:mod:`disagg.kit.grads.buckets`).

**State** is parameters + gradients + AdamW's two moments in the precision recipe's
dtypes (:data:`disagg.interfaces.precision.RECIPES`, ``Recipe.state_bytes_per_element``:
``fp32`` 16 bytes per element, ``bf16`` 18 — bf16 weight, fp32 master, gradient and
moments —, ``bf16-pure`` 8), plus AdamW's 4-byte ``step`` tensor per parameter tensor:
what :meth:`Strategy.state_bytes` counts after a step. A frozen element holds its weight
only (:mod:`disagg.kit.cost.training`). Gradients are reduced in the recipe's
gradient dtype (fp32 under ``fp32`` and ``bf16``). Activations and the residual stream are in
the recipe's compute dtype; the recipes do not autocast, so no bf16 copy of a weight is saved.

**Saved activations** are counted per saved tensor as
:func:`disagg.kit.recompute.activations.saved_bytes_hooks` counts them. Per token of
a block, from HF's code (sdpa): each of the two norms its input, the squared
input and the normalised output (``3H`` + 2 scalars); attention the qkv input
``H``, q/k/v and the output kept by sdpa ``4H``, the output projection's input
``H``, rotary cos/sin of q and k ``4·hd``, the log-sum-exp ``heads``; the MLP
``mlp_in`` inputs of width ``H`` and ``mlp_mid`` tensors of width ``I``
(SwiGLU: gate, its activation, up, their product). For a Qwen2.5-VL tower in
fp32 that is exact; elsewhere an estimate. A decoder adds the fp32 logits
(``2V``·4 bytes per token, as the hooks count the log-softmax output that the loss saves)
of one loss chunk (``parallel.llm.loss_chunk_tokens``, :mod:`disagg.kit.chunked_loss`):
``min(tokens, chunk)`` tokens, held while that chunk is replayed in backward.

**FLOPs**: training = 3 x forward; a matmul counts ``2·m·n·k`` (every weight of
2+ dims times the rows it sees); encoder attention per window (``window_tokens``
keys per query) in window blocks and over the whole sequence in full blocks;
decoder attention causal. Element-wise work is not counted in FLOPs; what a rank computes by
shape, element-wise bytes included, is :mod:`disagg.kit.cost.gemms`' (``Cost.compute``).

**Recomputation** (``parallel.<module>.recompute``): ``full`` keeps each
block's input and one block's saves while it is replayed and costs one more
forward of FLOPs (``4/3``); ``selective`` drops what the attention core saves
beyond its inputs (its output and log-sum-exp) and replays the core's FLOPs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from disagg.interfaces.cost import GRAD_BYTES, Workload
from disagg.interfaces.shapes import DecoderShape, EncoderShape, ParamTensor, Shape
from disagg.interfaces.strategy import DEFAULT_CHUNK_TOKENS
from disagg.kit.cost import tiled_mlp
from disagg.kit.grads.buckets import bucket_sizes

STATE_BYTES_PER_ELEMENT = 16  # fp32 parameter, gradient, exp_avg, exp_avg_sq
STEP_TENSOR_BYTES = 4  # AdamW's per-tensor step count (a 0-d fp32 tensor)
RECOMPUTE_MODES = ("none", "full", "selective")


# -- collectives ---------------------------------------------------------------------------------
def all_reduce(nbytes: int, n: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``n`` ranks."""
    return 2 * (n - 1) * nbytes // n if n > 1 else 0


def all_gather(shard_bytes: int, n: int) -> int:
    """Bytes one rank sends gathering its ``shard_bytes`` to ``n - 1`` peers (ring)."""
    return (n - 1) * shard_bytes


def reduce_scatter(nbytes: int, n: int) -> int:
    """Bytes one rank sends reduce-scattering a buffer whose output shard is ``nbytes``."""
    return (n - 1) * nbytes


def reduce(nbytes: int, n: int) -> int:
    """Bytes one rank sends in a ring reduce of ``nbytes`` (half an all-reduce)."""
    return (n - 1) * nbytes // n


def grad_all_reduce(tensors: list[int], n: int, grad_bytes: int = GRAD_BYTES) -> int:
    """``Strategy.reduce_gradients`` of the base class: ``agree_on_grads`` (one int32
    per tensor) then one all-reduce per 25 MiB bucket of gradients (torch DDP's
    bucketing, :func:`disagg.kit.bucket_sizes`) of ``grad_bytes`` per element."""
    if n == 1:
        return 0
    buckets = bucket_sizes(tensors, grad_bytes)
    return all_reduce(4 * len(tensors), n) + sum(
        all_reduce(grad_bytes * sum(tensors[i] for i in b), n) for b in buckets
    )


def grad_reduce_calls(tensors: list[int], n: int, grad_bytes: int = GRAD_BYTES) -> dict[str, int]:
    """Calls of the base class's reduction: ``agree_on_grads`` then one all-reduce
    per bucket, ``1 + buckets``."""
    return {"all_reduce": 1 + len(bucket_sizes(tensors, grad_bytes))} if n > 1 else {}


def replicated_comm(numels: list[int], w: Workload) -> dict[str, int]:
    """Every rank holds every parameter; gradients are summed over the whole group."""
    return {"all_reduce": grad_all_reduce(numels, w.world, w.grad_bytes)}


def transfer_bytes(w: Workload, split: int = 1) -> int:
    """Rows a rank ships to the other group: its replica's rows, ``1/split`` of them
    where ``split`` ranks share each sample's rows."""
    rows = w.samples_per_replica * w.exchanged_rows
    if split > 1:
        rows //= split
    return rows * w.exchanged_width * w.act_bytes


# -- state ---------------------------------------------------------------------------------------
def state_bytes(
    tensors: list[ParamTensor], tp_degree: int = 1, per_element: int = STATE_BYTES_PER_ELEMENT
) -> int:
    """Parameter + gradient + AdamW bytes on one rank that holds each tensor whole
    (``tp_degree`` 1) or its tensor-parallel slice, ``per_element`` bytes per element
    (the recipe's, :attr:`disagg.interfaces.cost.Workload.state_element`)."""
    elems = sum(t.local_numel(tp_degree) for t in tensors)
    return per_element * elems + STEP_TENSOR_BYTES * len(tensors)


# -- saved activations ---------------------------------------------------------------------------
def block_elems(shape: Shape, tiles: int | str = 1) -> int:
    """Saved elements per token of one block (layer) held whole; with ``mlp_tiles``
    (:mod:`disagg.kit.cost.tiled_mlp`) the MLP keeps its input only (``H``), its intermediates
    being one tile's peak (:func:`tile_peak_bytes`)."""
    h, i, hd, heads = shape.hidden, shape.intermediate, shape.head_dim, shape.heads
    mlp_in, mlp_mid = (shape.mlp_in, shape.mlp_mid) if isinstance(shape, EncoderShape) else (2, 4)
    if tiled_mlp.enabled(tiles):
        return 13 * h + 4 * hd + heads + 4
    return (12 + mlp_in) * h + 4 * hd + heads + 4 + mlp_mid * i


def tile_peak_bytes(shape: Shape, rows: int, act_bytes: int, tiles: int | str = 1) -> int:
    """One tile's MLP saves while it is replayed, on a rank whose MLPs read ``rows`` rows at a
    time whole (0 without tiles)."""
    return int(tiled_mlp.saves(shape, rows, tiles, shape.intermediate).peak * act_bytes)


#: towers whose HF code computes RMSNorm and the vision rotary in fp32 whatever the compute dtype
FP32_INTERNALS = ("qwen2_5_vl",)


def fp32_internal_bytes(shape: Shape, norm_tokens: float, rope_tokens: float, act_bytes: int) -> int:
    """What HF's code saves in fp32 beyond the compute dtype's bytes (0 in fp32): Qwen2's
    RMSNorm upcasts its input, so of its ``3H + 2`` saves per token the input (twice) and the
    rsqrt are fp32 (``2H + 2``, for each of the two norms per block and the final or merger norm,
    on ``norm_tokens``); Qwen2.5-VL's vision rotary upcasts cos/sin (``4·hd`` per token and block,
    on ``rope_tokens``). Decoders (Qwen2/Llama RMSNorm) and the Qwen2.5-VL tower; measured equal
    within the tiny model's few int64 tensors (``examples/bench/recipe_activations.py``)."""
    if act_bytes >= 4:
        return 0
    up = 4 - act_bytes
    if isinstance(shape, EncoderShape):
        if shape.family not in FP32_INTERNALS:
            return 0
        norms = 2 * shape.depth + 1
        rope = shape.depth * rope_tokens * 4 * shape.head_dim * up
    else:
        norms, rope = 2 * shape.layers + 1, 0
    return int(norms * norm_tokens * (2 * shape.hidden + 2) * up + rope)


def encoder_activation_bytes(shape: EncoderShape, tokens: int, act_bytes: int, tiles: int | str = 1) -> int:
    """Saved bytes of a whole tower on a rank holding ``tokens`` tokens of it (with ``tiles``, one
    tile's replay on top, its rows cut from all ``tokens``: an upper bound where images are encoded
    one by one)."""
    per_token = shape.input_elems + shape.depth * block_elems(shape, tiles) + shape.head_act
    extra = fp32_internal_bytes(shape, tokens, tokens, act_bytes) + tile_peak_bytes(
        shape, tokens, act_bytes, tiles
    )
    return int(tokens * per_token * act_bytes) + shape.window_index_bytes(tokens) + extra


def loss_tokens(tokens: int, chunk: int | None = DEFAULT_CHUNK_TOKENS) -> int:
    """Tokens whose logits exist at once: one loss chunk of ``tokens`` (all of them when
    ``chunk`` is None, the whole microbatch's)."""
    return tokens if not chunk else min(tokens, chunk)


def logits_bytes(vocab: int, tokens: int, chunk: int | None = DEFAULT_CHUNK_TOKENS) -> int:
    """The loss's saved fp32 logits (``2V``·4 bytes per token) of one chunk."""
    return 2 * vocab * 4 * loss_tokens(tokens, chunk)


def with_peaks(logits: int, tile: int, tokens: int, chunk: int | None = DEFAULT_CHUNK_TOKENS) -> int:
    """The loss's ``logits`` and an MLP tile's replayed saves (``tile``) on top of what is held:
    one loss chunk (``tokens <= chunk``) is not replayed, its logits are held with the rest;
    several are each replayed at the start of backward, never at once with a tile's replay."""
    return logits + tile if loss_tokens(tokens, chunk) == tokens else max(logits, tile)


def decoder_activation_bytes(
    shape: DecoderShape,
    tokens: int,
    act_bytes: int,
    chunk: int | None = DEFAULT_CHUNK_TOKENS,
    tiles: int | str = 1,
) -> int:
    """Saved bytes of a whole decoder for ``tokens`` tokens in one forward (an estimate):
    every layer's and the head's input for every token, the logits of one loss chunk (with
    ``tiles``: one MLP tile's replay on top, :func:`with_peaks`)."""
    per_token = shape.layers * block_elems(shape, tiles) + 4 * shape.hidden
    extra = fp32_internal_bytes(shape, tokens, 0, act_bytes)
    logits = logits_bytes(shape.vocab, tokens, chunk)
    tile = tile_peak_bytes(shape, tokens, act_bytes, tiles)
    return int(tokens * per_token * act_bytes) + with_peaks(logits, tile, tokens, chunk) + extra


def activation_bytes(
    shape: Shape, tokens: int, act_bytes: int, chunk: int | None = DEFAULT_CHUNK_TOKENS, tiles: int | str = 1
) -> int:
    if isinstance(shape, EncoderShape):
        return encoder_activation_bytes(shape, tokens, act_bytes, tiles)
    return decoder_activation_bytes(shape, tokens, act_bytes, chunk, tiles)


# -- FLOPs ---------------------------------------------------------------------------------------
def encoder_flops(shape: EncoderShape, n: int) -> float:
    """One sample of ``n`` encoder tokens."""
    dense = 2 * sum(t.matmul_rows(n) * t.numel for t in shape.tensors())
    full = len(shape.full_blocks)
    attn = 4 * n * shape.hidden * (full * n + (shape.depth - full) * min(shape.window_tokens, n))
    return 3.0 * (dense + attn)


def decoder_flops(shape: DecoderShape, n: int) -> float:
    """One sequence of ``n`` tokens."""
    h, i, hd = shape.hidden, shape.intermediate, shape.head_dim
    q, kv = shape.heads * hd, shape.kv_heads * hd
    per_layer = 2 * n * (h * (q + 2 * kv) + q * h + 3 * h * i) + 2 * n * n * q  # causal QK^T and AV
    return 3.0 * (shape.layers * per_layer + 2 * n * h * shape.vocab)


def train_flops(shape: Shape, n: int) -> float:
    return encoder_flops(shape, n) if isinstance(shape, EncoderShape) else decoder_flops(shape, n)


# -- recomputation -------------------------------------------------------------------------------
def recompute_mode(value: str | bool | None) -> str:
    """``recompute`` as a mode (``True`` is the old spelling of ``full``)."""
    if value is True:
        return "full"
    if value in (False, None):
        return "none"
    if value not in RECOMPUTE_MODES:
        raise ValueError(f"recompute {value!r} is not one of: {', '.join(RECOMPUTE_MODES)}")
    return str(value)


def blocks_of(shape: Shape) -> int:
    return shape.depth if isinstance(shape, EncoderShape) else shape.layers


def one_block(shape: Shape) -> Shape:
    """``shape`` cut to one block (what is live while one block is replayed)."""
    if isinstance(shape, EncoderShape):
        return replace(shape, depth=1, full_blocks=(0,) if shape.full_blocks else ())
    return replace(shape, layers=1)


def recomputed_activation_bytes(
    shape: Shape, held: int, act_bytes: int, layer_bytes: Callable[[Shape], int]
) -> int:
    """Saved bytes under ``full`` recomputation: each block's input for the ``held``
    tokens the rank keeps, plus ``layer_bytes(one_block(shape))`` (the strategy's own
    count of one block's saves, and a decoder's logits)."""
    return blocks_of(shape) * held * shape.hidden * act_bytes + layer_bytes(one_block(shape))


def extra_flops(shape: Shape, seq_len: int, flops: float, mode: str) -> float:
    """FLOPs per sample a replay adds to ``flops`` (forward + backward)."""
    if mode == "full":
        return flops / 3.0
    if mode == "selective":
        if isinstance(shape, EncoderShape):
            full = len(shape.full_blocks)
            n = seq_len
            return 4.0 * n * shape.hidden * (full * n + (shape.depth - full) * min(shape.window_tokens, n))
        return 2.0 * seq_len * seq_len * shape.heads * shape.head_dim * shape.layers
    return 0.0


def selective_saving(shape: Shape, tokens_held: int, act_bytes: int) -> int:
    """Bytes ``selective`` does not hold: per block and held token, the attention
    output (``H``) and the log-sum-exp (``heads``) that the core saved."""
    return int(blocks_of(shape) * tokens_held * (shape.hidden + shape.heads) * act_bytes)


def with_recompute(
    shape: Shape,
    mode: str,
    saved: int,
    act_bytes: int,
    *,
    full_held: int,
    selective_held: int,
    layer_bytes: Callable[[Shape], int],
) -> int:
    """``saved`` (the bytes held without recomputation) under ``mode``."""
    if mode == "full":
        return recomputed_activation_bytes(shape, full_held, act_bytes, layer_bytes)
    if mode == "selective":
        return saved - selective_saving(shape, selective_held, act_bytes)
    return saved


def replica_activation_bytes(
    shape: Shape,
    mode: str,
    tokens: int,
    act_bytes: int,
    chunk: int | None = DEFAULT_CHUNK_TOKENS,
    tiles: int | str = 1,
) -> int:
    """Saved bytes of a rank that runs the whole module on its own ``tokens`` (``ddp``, ``zero``:
    no activation split across ranks) under recompute ``mode`` (``tiles``: ``mlp_tiles``)."""
    return with_recompute(
        shape,
        mode,
        activation_bytes(shape, tokens, act_bytes, chunk, tiles),
        act_bytes,
        full_held=tokens,
        selective_held=tokens,
        layer_bytes=lambda one: activation_bytes(one, tokens, act_bytes, chunk, tiles),
    )
