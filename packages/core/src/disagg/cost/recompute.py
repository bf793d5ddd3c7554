"""What activation recomputation (``parallel.<module>.recompute``) costs and saves.

Memory (:mod:`.memory`): ``full`` keeps each block's input and, during
backward, one block's saves at a time (:func:`.memory.recomputed_activation_bytes`);
``selective`` drops what the attention core saves beyond its inputs (the
attention output and the log-sum-exp per head: sdpa-style attention saves no
score matrix, so this is small; eager attention would save far more).

Time: ``full`` replays every block's forward once in backward (early stop is
off, :mod:`disagg.interfaces.recompute`): one forward of FLOPs more (training
is 3 forwards, so ``4/3``), and the blocks' *forward* collectives again: the
ulysses all-to-alls of the full-attention blocks, Megatron's row-parallel
output all-reduces (with sequence parallelism their reduce-scatters; the norm
gathers replace the backward re-gathers of the saved shards, so all-gathers
stay as many). A column linear's input-gradient all-reduce runs in backward
once either way. ``selective`` replays the attention core's FLOPs and no
collective (the core sits between the all-to-alls).
"""

from __future__ import annotations

from disagg.cost.comm import Workload, all_reduce
from disagg.cost.shapes import DecoderShape, Shape, VisionShape

MODES = ("none", "full", "selective")


def mode_of(value: str | bool | None) -> str:
    """``recompute`` as a mode (``True`` is the old spelling of ``full``)."""
    if value is True:
        return "full"
    if value in (False, None):
        return "none"
    if value not in MODES:
        raise ValueError(f"recompute {value!r} is not one of: {', '.join(MODES)}")
    return str(value)


def _blocks(shape: Shape) -> int:
    return shape.depth if isinstance(shape, VisionShape) else shape.layers  # type: ignore[union-attr]


def replay_comm(
    shape: Shape, strategy: str, w: Workload, sequence_parallel: bool, mode: str
) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes and calls by kind that a ``full`` replay adds per rank per step."""
    if mode != "full" or w.degree == 1:
        return {}, {}
    s, m, e, h = w.samples_per_replica, w.microbatches, w.act_bytes, shape.hidden
    if strategy == "ulysses":
        assert isinstance(shape, VisionShape)
        full = len(shape.full_blocks)
        n_local = w.tokens_per_replica // w.degree
        # the forward's two all-to-alls per full-attention block (half of ulysses_comm's 8)
        return (
            {"all_to_all": full * 4 * (w.degree - 1) * n_local * (h // w.degree) * e},
            {"all_to_all": 2 * full * m},
        )
    if strategy == "megatron_tp":
        blocks, n = _blocks(shape), w.seq_len
        if isinstance(shape, VisionShape):
            m = max(s, m)  # an encoder's samples are encoded one by one (calls.megatron_vision_calls)
        if sequence_parallel:
            shard = (w.degree - 1) * -(-n // w.degree) * h * e
            return {"reduce_scatter": s * 2 * blocks * shard}, {"reduce_scatter": 2 * blocks * m}
        rows = s * 2 * blocks * all_reduce(n * h * e, w.degree)
        return {"all_reduce": rows}, {"all_reduce": 2 * blocks * m}
    return {}, {}


def extra_flops(shape: Shape, seq_len: int, train_flops: float, mode: str) -> float:
    """FLOPs per sample the replay adds to ``train_flops`` (forward + backward)."""
    if mode == "full":
        return train_flops / 3.0
    if mode == "selective":
        if isinstance(shape, VisionShape):
            full = len(shape.full_blocks)
            n = seq_len
            return 4.0 * n * shape.hidden * (full * n + (shape.depth - full) * min(shape.window_tokens, n))
        assert isinstance(shape, DecoderShape)
        return 2.0 * seq_len * seq_len * shape.heads * shape.head_dim * shape.layers
    return 0.0


def selective_saving(shape: Shape, tokens_held: int, act_bytes: int) -> int:
    """Bytes ``selective`` does not hold: per block and held token, the attention
    output (``H``) and the log-sum-exp (``heads``) that the core saved."""
    return int(_blocks(shape) * tokens_held * (shape.hidden + shape.heads) * act_bytes)
