"""Training FLOPs (forward + backward = 3 x forward), per sample.

Matrix multiplies count ``2·m·n·k``. Vision attention is per window
(``window_tokens`` keys per query) in window blocks and per image (all ``N``)
in full-attention blocks; decoder attention is causal (half the square).
Element-wise work is ignored. Per rank: divide by the ranks that share the
sample (``ulysses``/``megatron_tp`` degree), which is the ideal split.
"""

from __future__ import annotations

from disagg.cost.shapes import DecoderShape, VisionShape


def vision_flops(shape: VisionShape, n: int) -> float:
    """One image of ``n`` patches."""
    h, i = shape.hidden, shape.intermediate
    patch = shape.in_channels * shape.temporal_patch * shape.patch**2
    dense = 2 * n * (patch * h + shape.depth * (4 * h * h + 3 * h * i))
    dense += 2 * (n // shape.unit) * (shape.unit * h) * (shape.unit * h + shape.out_hidden)
    full = len(shape.full_blocks)
    attn = 4 * n * h * (full * n + (shape.depth - full) * min(shape.window_tokens, n))
    return 3.0 * (dense + attn)


def llm_flops(shape: DecoderShape, n: int) -> float:
    """One sequence of ``n`` tokens."""
    h, i, hd = shape.hidden, shape.intermediate, shape.head_dim
    q, kv = shape.heads * hd, shape.kv_heads * hd
    per_layer = 2 * n * (h * (q + 2 * kv) + q * h + 3 * h * i) + 2 * n * n * q  # causal QK^T and AV
    return 3.0 * (shape.layers * per_layer + 2 * n * h * shape.vocab)
