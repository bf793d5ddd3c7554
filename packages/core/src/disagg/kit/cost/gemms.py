"""Compute rules: the matmuls, attention cores and element-wise bytes of a module held
whole or split (:class:`~disagg.interfaces.compute.Split`), for a strategy's cost hook.
The types and what each field counts are in :mod:`disagg.interfaces.compute`."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from disagg.interfaces.compute import TRAIN_PASSES, AttentionCore, Compute, Gemm, Split
from disagg.interfaces.shapes import DecoderShape, EncoderShape, ParamTensor


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def tensor_gemm(t: ParamTensor, rows: int, split: Split) -> Gemm | None:
    """The product a weight of 2+ dims does for ``rows`` rows on one rank (None: a 1-D tensor)."""
    if len(t.shape) < 2 or rows <= 0:
        return None
    out, inner = t.shape[0], t.numel // t.shape[0]
    d = split.tp
    if d > 1:
        if t.tp in ("column", "vocab"):
            out = _ceil(out, d)
        elif t.tp == "kv":
            out = out // d if t.heads % d == 0 else out // max(t.heads, 1)
        elif t.tp == "row":
            inner = inner // d
    return Gemm(_ceil(rows, split.tokens), out, inner)


def _grouped(gemms: list[Gemm], passes: float) -> tuple[Gemm, ...]:
    """Identical shapes once, their counts summed (a 64-layer decoder: a few entries)."""
    counts: Counter[tuple[int, int, int]] = Counter()
    for g in gemms:
        counts[(g.m, g.n, g.k)] += g.count
    return tuple(Gemm(m, n, k, c * passes) for (m, n, k), c in counts.items())


def _heads(heads: int, split: Split) -> int:
    return max(1, heads // split.heads)


def _elementwise(token_wise: float, width_wise: float, n: int, split: Split, e: int) -> float:
    """Forward bytes of ``token_wise`` (norms, residuals) and ``width_wise`` (split by TP)
    elements per token, for ``n`` tokens of one sample on one rank."""
    seq = split.tokens * (split.tp if split.sequence_parallel else 1)
    return e * (token_wise * n / seq + width_wise * n / (split.tokens * split.tp))


def encoder_compute(shape: EncoderShape, n: int, split: Split, elem_bytes: int) -> Compute:
    """One sample of ``n`` tokens through a tower, training, on one rank of ``split``."""
    gemms = [g for t in shape.tensors() if (g := tensor_gemm(t, t.matmul_rows(n), split))]
    heads, hd = _heads(shape.heads, split), shape.head_dim
    full = len(shape.full_blocks)
    w = min(shape.window_tokens, n)  # 0: a tower without windows attends only in its full blocks
    attention = [AttentionCore(n, n, hd, heads, 1, count=full * TRAIN_PASSES)] if full else []
    if shape.depth > full and w:
        windows = _ceil(n, w)
        attention.append(AttentionCore(w, w, hd, heads, windows, count=(shape.depth - full) * TRAIN_PASSES))
    h, i = shape.hidden, shape.intermediate
    block = _elementwise(10 * h, 4 * h + (shape.mlp_mid + 1) * i, n, split, elem_bytes)
    head = _elementwise(2 * h, 2 * shape.out_hidden / shape.unit, n, split, elem_bytes)
    return Compute(
        gemms=_grouped(gemms, TRAIN_PASSES),
        attention=tuple(attention),
        elementwise_bytes=TRAIN_PASSES * (shape.depth * block + head),
        elem_bytes=elem_bytes,
    )


def decoder_compute(shape: DecoderShape, n: int, split: Split, elem_bytes: int) -> Compute:
    """One sequence of ``n`` tokens through a decoder, training, on one rank of ``split``
    (the embedding is a lookup, the output layer a product over the vocabulary)."""
    h, i, hd = shape.hidden, shape.intermediate, shape.head_dim
    q, kv = shape.heads * hd, shape.kv_heads * hd
    layer = [
        ParamTensor("q", (q, h), "column"),
        ParamTensor("k", (kv, h), "kv", shape.kv_heads),
        ParamTensor("v", (kv, h), "kv", shape.kv_heads),
        ParamTensor("o", (h, q), "row"),
        ParamTensor("gate", (i, h), "column"),
        ParamTensor("up", (i, h), "column"),
        ParamTensor("down", (h, i), "row"),
    ]
    gemms = [replace(g, count=shape.layers) for t in layer if (g := tensor_gemm(t, n, split))]
    head = tensor_gemm(ParamTensor("lm_head", (shape.vocab, h), "vocab"), n, split)
    gemms += [head] if head else []
    attention = (
        AttentionCore(n, n, hd, _heads(shape.heads, split), causal=True, count=shape.layers * TRAIN_PASSES),
    )
    per_layer = _elementwise(10 * h, 2 * (q + kv) + 5 * i, n, split, elem_bytes)
    tail = _elementwise(2 * h, 3 * shape.vocab, n, split, elem_bytes)
    return Compute(
        gemms=_grouped(gemms, TRAIN_PASSES),
        attention=attention,
        elementwise_bytes=TRAIN_PASSES * (shape.layers * per_layer + tail),
        elem_bytes=elem_bytes,
    )


def module_compute(shape: EncoderShape | DecoderShape, n: int, split: Split, elem_bytes: int) -> Compute:
    if isinstance(shape, EncoderShape):
        return encoder_compute(shape, n, split, elem_bytes)
    return decoder_compute(shape, n, split, elem_bytes)


def strategy_compute(
    shape: EncoderShape | DecoderShape, n: int, split: Split, elem_bytes: int, mode: str
) -> Compute:
    """:func:`module_compute` with recompute ``mode``'s replay on top."""
    return module_compute(shape, n, split, elem_bytes).with_recompute(mode)


__all__ = [
    "TRAIN_PASSES",
    "AttentionCore",
    "Compute",
    "Gemm",
    "Split",
    "decoder_compute",
    "encoder_compute",
    "module_compute",
    "strategy_compute",
    "tensor_gemm",
]
