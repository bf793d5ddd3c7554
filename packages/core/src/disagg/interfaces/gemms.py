"""The compute a rank does, by shape: what a strategy's cost hook states so that the
planner charges each matmul at the efficiency its shape reaches.

A :class:`Compute` lists a rank's matrix products (:class:`Gemm`: ``m x k`` times
``k x n``, forward and the two backward products, which have the same three
dimensions permuted), its fused attention cores (:class:`AttentionCore`, a
FlashAttention-style kernel: queries, keys and values read once, the scores never
leave the chip) and the bytes its element-wise work moves (norms, residual adds,
rotary embeddings, activations, the loss's softmax). How fast each runs on a
machine is the planner's business (:mod:`disagg.plan.efficiency`); a strategy only
says what its layout leaves a rank to do:

- ``tokens``: ranks that split each sample's tokens for the dense layers
  (sequence parallelism à la Ulysses: every matmul sees ``n / tokens`` rows, full width);
- ``tp``: ranks that split every column / row / vocabulary / key-value weight
  (tensor parallelism: the matmul sees all ``n`` rows and ``1/tp`` of the width; a
  ``replicated`` weight stays whole on every rank);
- attention is split by heads over ``tokens x tp`` ranks either way;
- ``sequence_parallel`` (with ``tp``): the token-wise element-wise work (norms,
  residual adds) is split over the ``tp`` ranks too; without it every TP rank
  repeats it for all ``n`` tokens at full width.

**Element-wise bytes** per token, forward, as elements moved (read + written, at the
compute dtype): each norm ``2H``, each residual add ``3H`` (two blocks of each per
layer: ``10H``, token-wise); the rotary embedding of queries and keys ``2(q + kv)``
(``4H`` in a tower) and the MLP's activation ``(mlp_mid + 1)·I`` (SwiGLU: SiLU reads
and writes ``I``, the product reads ``2I`` and writes ``I``: ``5I``; GELU ``3I``),
both width-wise; a tower's merger its norm (``2H``) and activation (``2·O`` per
output row); a decoder's final norm (``2H``) and the loss over its logits (``3V``:
the log-softmax reads and writes them, the target gather reads them, split by
vocabulary under ``tp``). Biases are added in the GEMMs' epilogues and softmax
runs inside the fused attention, so neither moves extra bytes. Training counts
3 x the forward's work, as the FLOPs do (a backward element-wise op reads its input
and the output gradient and writes the input gradient).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from disagg.interfaces.shapes import DecoderShape, EncoderShape, ParamTensor

#: forward + two backward products (training = 3 x forward, as the FLOP count)
TRAIN_PASSES = 3


@dataclass(frozen=True)
class Gemm:
    """``count`` products of an ``m x k`` by a ``k x n`` matrix (per step once assembled)."""

    m: int
    n: int
    k: int
    count: float = 1.0

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


@dataclass(frozen=True)
class AttentionCore:
    """``count`` fused attention passes over ``windows`` independent windows of
    ``queries`` queries and ``keys`` keys, ``heads`` heads of ``head_dim`` on this rank."""

    queries: int
    keys: int
    head_dim: int
    heads: int
    windows: int = 1
    causal: bool = False
    count: float = 1.0

    @property
    def flops(self) -> float:
        """``QK^T`` and ``AV``: ``4·q·k·hd`` per head and window, half of it causal."""
        f = 4.0 * self.queries * self.keys * self.head_dim * self.heads * self.windows * self.count
        return f / 2 if self.causal else f


@dataclass(frozen=True)
class Compute:
    """What one rank computes (per sample while a strategy builds it; per step in a :class:`Cost`)."""

    gemms: tuple[Gemm, ...] = ()
    attention: tuple[AttentionCore, ...] = ()
    #: bytes the element-wise work reads and writes
    elementwise_bytes: float = 0.0
    #: bytes per element of the compute dtype (2 under bf16, 4 in fp32)
    elem_bytes: int = 4

    @property
    def flops(self) -> float:
        return sum(g.flops for g in self.gemms) + sum(a.flops for a in self.attention)

    def scaled(self, factor: float, *, dense: bool = True, elementwise: bool = True) -> Compute:
        """Every count times ``factor`` (``dense``/``elementwise`` False: attention only)."""
        return replace(
            self,
            gemms=tuple(replace(g, count=g.count * factor) for g in self.gemms) if dense else self.gemms,
            attention=tuple(replace(a, count=a.count * factor) for a in self.attention),
            elementwise_bytes=self.elementwise_bytes * (factor if elementwise else 1.0),
        )

    def with_recompute(self, mode: str) -> Compute:
        """A replay's work on top (:func:`disagg.interfaces.cost_rules.extra_flops`): ``full``
        runs every forward once more (``4/3``), ``selective`` the attention cores."""
        if mode == "full":
            return self.scaled(4 / 3)
        if mode == "selective":
            return self.scaled(4 / 3, dense=False, elementwise=False)
        return self


@dataclass(frozen=True)
class Split:
    """How a layout divides one sample's work over the ranks that share it (module docstring)."""

    tokens: int = 1
    tp: int = 1
    sequence_parallel: bool = False

    @property
    def heads(self) -> int:
        return self.tokens * self.tp


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
