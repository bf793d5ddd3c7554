"""Rank function of the sequence-tiled MLP tests (``parallel.<module>.mlp_tiles``, importable by
spawned ranks): each layout of :data:`RUNS` without tiles and with :data:`TILES` tiles, 3 steps of 2
microbatches (weight decay on, clipping on, training mode), recording at every step the loss, the
grad norm, the merged gradients and parameters, and every microbatch's saved bytes as the worker
counts them (``offload_cases._counted``: the device peak, a replayed block's and a replayed tile's
saves on top of what is held). One spawn of 2 ranks for all of it, on the offload tests' tiny
models and data (``offload_cases``): the tiny Qwen2 LM under ``megatron_tp`` 2 with and without
sequence parallelism, the tiny LLaVA tower under ``ddp`` x 2 and ``ulysses`` 2 (and with
``shard: parameters``, FSDP2 around the tiled blocks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from offload_cases import STEPS, _strategy, _train

from disagg.testing import ranks

#: tiles per MLP: the microbatches' rows (15 and 20 per rank under sequence parallelism, 30 and 40
#: without it, 2 x 29-ish patches per LLaVA image) are not multiples of it: uneven tiles
TILES = 4
#: (layout, precision, recompute)
RUNS = (
    ("megatron_tp-sp", "fp32", "none"),
    ("megatron_tp-sp", "fp32", "full"),
    ("megatron_tp-sp", "bf16", "none"),
    ("megatron_tp-sp", "bf16", "full"),
    ("megatron_tp", "fp32", "none"),
    ("megatron_tp", "fp32", "full"),
    ("ddp", "fp32", "none"),
    ("ddp", "fp32", "full"),
    ("ulysses", "fp32", "none"),
    ("ulysses", "fp32", "full"),
    ("ulysses-fsdp", "bf16", "full"),
)


def tiles_rank(
    rank: int, paths: dict[str, str], data: dict[str, dict[str, Any]], runs: tuple = RUNS
) -> bytes:
    out: dict[Any, Any] = {}
    for layout, precision, recompute in runs:
        d = data["qwen2" if layout.startswith("megatron_tp") else "vision"]
        for tiles in (1, TILES):
            res: dict[str, Any] = {}
            strat = _strategy(layout, rank, precision, False, paths, recompute, {"mlp_tiles": tiles})
            # Hugging Face checkpoints its layers in training mode only; the same seeds draw the
            # same dropout masks in both runs (a tile's replay restores the streams it found)
            strat.module.train()
            _train(layout, strat, d, range(STEPS), res, count=True)
            dir_ = Path(paths["qwen2" if layout.startswith("megatron_tp") else "llava"])
            res["shape"] = type(strat.family).planning_shape(json.loads((dir_ / "config.json").read_text()))
            # every collective since the strategy was built (its set-up, then the 3 steps)
            res["comm"] = {"bytes": dict(strat.ctx.comm.bytes_by_op), "calls": strat.ctx.comm.calls()}
            out[(layout, precision, recompute, tiles)] = res
    return ranks.dumps(out)
