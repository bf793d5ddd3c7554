"""The cost of ``parallel.<module>.mlp_tiles`` (:mod:`disagg.kit.recompute.tiled_mlp`), for the
strategies' cost hooks.

Saved activations: a block's MLP saves, per token of its input rows, ``mlp_in`` inputs of width
``H`` (SwiGLU: gate and up each save the input; fc1 alone: 1) and ``mlp_mid`` tensors of the
intermediate width (SwiGLU: gate, its activation, up, their product: 4; fc1 -> activation: 2),
:mod:`disagg.kit.cost.rules`' per-token rule. Tiled, the block keeps each tile's input instead
(the MLP's input once: ``H`` per row, saved by the tile's checkpoint) and, while one tile is
replayed in backward, that tile's saves (``tile rows x (mlp_in·H + mlp_mid·I)``, the largest tile:
``torch.tensor_split``'s first, ``ceil(rows / tiles)`` rows). A strategy states where its rows are
(a rank's own, or a sequence-parallel shard gathered per tile) and its widths.

Work: every tile is replayed once in backward, so the MLPs' forward runs once more
(``2·(mlp_in + 1)·H·I`` FLOPs per token and block, and its GEMMs in :class:`Compute`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from disagg.interfaces.compute import Compute, Gemm, Split
from disagg.interfaces.shapes import EncoderShape, Shape
from disagg.kit.recompute.tiled_mlp import AUTO, enabled, tile_count, tile_rows

__all__ = [
    "AUTO",
    "MLPSaves",
    "enabled",
    "mlp_widths",
    "replay_compute",
    "replay_flops",
    "saves",
    "tile_count",
]


def mlp_widths(shape: Shape) -> tuple[int, int]:
    """``(mlp_in, mlp_mid)``: a decoder's SwiGLU (2, 4); an encoder's from its shape."""
    return (shape.mlp_in, shape.mlp_mid) if isinstance(shape, EncoderShape) else (2, 4)


def _blocks(shape: Shape) -> int:
    return shape.depth if isinstance(shape, EncoderShape) else shape.layers


@dataclass(frozen=True)
class MLPSaves:
    """Elements one block's MLP saves on one rank, without and with tiles."""

    #: without tiles: every row's inputs and intermediates (the strategy's own count)
    whole: float
    #: with tiles, held through the step: every tile's input
    held: float
    #: with tiles, while one tile is replayed: its saves (a peak on top of what is held)
    peak: float


def saves(
    shape: Shape,
    rows: int,
    tiles: int | str,
    mid_width: float,
    in_rows: float | None = None,
    gather: int = 1,
) -> MLPSaves:
    """One block's MLP saves (elements) on a rank whose MLP reads ``rows`` rows: ``mid_width``
    intermediate columns per row (``I``, or ``I/d`` under tensor parallelism); ``in_rows``: the
    rows whose inputs the untiled MLP saves at width ``H`` (default ``rows``; a sequence-parallel
    rank saves its shard); ``gather``: ranks whose tile rows one tile gathers (sequence
    parallelism: the tile runs on ``gather x`` its rows, and its inputs are saved gathered)."""
    mlp_in, mlp_mid = mlp_widths(shape)
    h = shape.hidden
    in_rows = rows if in_rows is None else in_rows
    whole = mlp_in * h * in_rows + mlp_mid * mid_width * rows * gather
    if not enabled(tiles):
        return MLPSaves(whole, whole, 0.0)
    t = gather * tile_rows(tiles, rows, h, gather)
    return MLPSaves(whole, h * rows, t * (mlp_in * h + mlp_mid * mid_width))


def replay_flops(shape: Shape, tokens: int, tiles: int | str) -> float:
    """FLOPs per sample of ``tokens`` tokens the tiles' replay adds (one forward of every MLP)."""
    if not enabled(tiles):
        return 0.0
    mlp_in, _ = mlp_widths(shape)
    return 2.0 * tokens * (mlp_in + 1) * shape.hidden * shape.intermediate * _blocks(shape)


def replay_compute(
    compute: Compute | None, shape: Shape, tokens: int, split: Split, tiles: int | str
) -> Compute | None:
    """``compute`` with the tiles' replay on top: one forward of every block's MLP GEMMs on this
    rank's rows (``split``: its share of the tokens and of the intermediate width)."""
    if compute is None or not enabled(tiles):
        return compute
    mlp_in, _ = mlp_widths(shape)
    h, i, d = shape.hidden, shape.intermediate, split.tp
    m = -(-tokens // split.tokens)
    blocks = _blocks(shape)
    extra = (Gemm(m, -(-i // d), h, mlp_in * blocks), Gemm(m, h, i // d, blocks))
    return replace(compute, gemms=compute.gemms + extra)
