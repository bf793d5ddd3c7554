"""``parallel.<module>.mlp_tiles: N``: each block's MLP runs over the sequence in ``N`` tiles, each
tile checkpointed, so one tile's intermediates exist at a time (sequence-tiled MLP, as Snowflake's
Arctic Long Sequence Training, ALST, does).

An MLP is per token (no token sees another), so running it on row tiles and concatenating gives
the same rows. What changes is memory: without tiles a block holds, for every token, the MLP's
inputs and its intermediates (SwiGLU: gate, its activation, up and their product, ``4·I`` per
token, the block's largest part at long sequences); with tiles it holds each tile's input (the
MLP's input once, ``H`` per token) and, while one tile is replayed in backward, that tile's
intermediates. The forward of the MLP runs once more (the tile's replay); the weight gradients are
a sum over tiles instead of one matmul over all tokens (another summation order: equal within the
tolerance policy, not bit for bit).

Which modules: the family declares them (:attr:`disagg.interfaces.LayerMap.mlp`), never guessed:
a token mixer tiled by mistake (a gated-delta-net) would be silently wrong.

How: the module's ``forward`` is replaced by :class:`TiledForward` (an instance attribute, so
parameter names, module hooks and a block's own recompute stay as they are); the tiles are
``torch.tensor_split`` of the flattened rows (sizes differ by at most one when the rows are not
divisible by ``N``), each run under the strategy's :meth:`Recompute.tile
<disagg.kit.recompute.Recompute.tile>` (torch's non-reentrant checkpoint with the strategy's
random streams and captured state replayed, and the replay's saves counted). Torch's public
checkpoint, not DeepSpeed's ``TiledMLP``: its backward calls ``torch.autograd.backward`` itself
and marks ZeRO's ``ds_grad_is_ready`` (its own comment says DDP and FSDP need something else), and
core does not depend on DeepSpeed. A strategy whose MLP input is not the rows it owns (Megatron
sequence parallelism: each rank holds a shard of the rows, the column linears read them gathered)
passes ``around``: a wrapper of the MLP's forward per tile (there, gather the tile's rows first).

``mlp_tiles: auto``: ``ceil(rows / hidden)`` tiles, ALST's rule, so one tile is about
``hidden`` rows whatever the sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from disagg.interfaces import Family, LayerMap

#: what ``mlp_tiles`` accepts besides a positive int
AUTO = "auto"

Forward = Callable[..., torch.Tensor]


def tile_count(value: int | str, rows: int, hidden: int, gather: int = 1) -> int:
    """Tiles for ``rows`` rows of width ``hidden``: ``value``, or ALST's ``ceil(rows / hidden)``
    for ``auto`` (``gather``: ranks whose rows one tile gathers, so that a gathered tile is about
    ``hidden`` rows); never more than ``rows`` (no empty tile) and at least 1."""
    n = math.ceil(gather * rows / max(hidden, 1)) if value == AUTO else int(value)
    return max(1, min(n, rows))


def tile_rows(value: int | str, rows: int, hidden: int, gather: int = 1) -> int:
    """Rows of the largest tile (``torch.tensor_split``'s first)."""
    return -(-rows // tile_count(value, rows, hidden, gather)) if rows else 0


def enabled(value: int | str | None) -> bool:
    return value is not None and value != 1


def mlp_problems(lmap: LayerMap | None, family: str, where: str) -> list[str]:
    """Why ``mlp_tiles`` cannot run on this family's module (sentences naming ``where``)."""
    if lmap is None or not lmap.mlp:
        return [
            f"{where}.mlp_tiles: family {family!r} declares no per-token MLP modules (LayerMap.mlp), "
            "so its MLPs cannot be tiled; allowed: 1"
        ]
    return []


def family_problems(family: Family, name: str, where: str) -> list[str]:
    """:func:`mlp_problems` of ``family``'s layer map, for validation and the planner alike (a
    family whose ``layer_map`` raises has no MLPs to tile; the strategy's own check reports a
    family it cannot split)."""
    try:
        lmap = family.layer_map()
    except Exception:
        lmap = None
    return mlp_problems(lmap, name, where)


def mlp_modules(module: nn.Module, lmap: LayerMap) -> list[tuple[str, nn.Module, str]]:
    """(name, module, name of the norm that feeds it or '') of every declared MLP of ``module``."""
    out = []
    for name, mod in module.named_modules():
        for pattern, norm in lmap.mlp.items():
            if name and fnmatchcase(name, pattern):
                parent = name.rpartition(".")[0]
                out.append((name, mod, f"{parent}.{norm}" if norm and parent else norm))
                break
    return out


class TiledForward:
    """An MLP's forward over row tiles of its first argument (the hidden states)."""

    def __init__(
        self,
        forward: Forward,
        tiles: int | str,
        checkpoint: Callable[..., torch.Tensor],
        around: Callable[[Forward], Forward] | None = None,
        gather: int = 1,
    ) -> None:
        self.forward, self.tiles, self.checkpoint, self.gather = forward, tiles, checkpoint, gather
        self.run = around(forward) if around is not None else forward

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        n = tile_count(self.tiles, rows.shape[0], rows.shape[-1], self.gather)
        if n == 1 and self.run is self.forward:
            return self.forward(x, *args, **kwargs)
        grad = torch.is_grad_enabled()
        outs = [
            self.checkpoint(self.run, part, *args, **kwargs) if grad else self.run(part, *args, **kwargs)
            for part in torch.tensor_split(rows, n)
        ]
        out = torch.cat(outs)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def apply(
    module: nn.Module,
    lmap: LayerMap | None,
    tiles: int | str,
    checkpoint: Callable[..., torch.Tensor],
    around: Callable[[str, str], Callable[[Forward], Forward] | None] | None = None,
    gather: int = 1,
) -> list[str]:
    """Tile every declared MLP of ``module`` (``checkpoint``: the strategy's
    :meth:`~disagg.kit.recompute.Recompute.tile`; ``around(name, norm)``: the per-tile wrapper for
    the MLP ``name`` fed by ``norm``, or None; ``gather``: ranks whose rows a tile gathers, for
    ``auto``); returns the names. Nothing when ``tiles`` is 1."""
    if not enabled(tiles):
        return []
    if lmap is None or not lmap.mlp:
        raise ValueError("mlp_tiles: the family declares no per-token MLP modules (LayerMap.mlp); allowed: 1")
    found = mlp_modules(module, lmap)
    if not found:
        raise ValueError(f"mlp_tiles: the family's MLP patterns {sorted(lmap.mlp)} match no module")
    for name, mod, norm in found:
        wrap = around(name, norm) if around is not None else None
        mod.forward = TiledForward(mod.forward, tiles, checkpoint, wrap, gather)  # type: ignore[method-assign]
    return [name for name, _, _ in found]
