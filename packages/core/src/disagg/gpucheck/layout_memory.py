"""Part 1's memory figure, per layout: the allocator's peak while the layout's steps run beside
the cost model's prediction for the same run (issue: a memory model checked against an
allocator, not only bookkeeping).

Measured: ``torch.cuda.max_memory_allocated`` over the layout's steps (its set-up included:
weights, masters, optimizer state, the batch, every activation and transient), less what was
allocated before it started (the reference's leftovers), so the figure is what this layout
holds at its peak on the one device both groups share. Predicted: the sum over both groups
of each strategy's ``Cost.memory_bytes`` (state + saved activations + gathered weights) for the
check's batch: every sample in one microbatch, the mean length of its images and sequences, the
run's recipe and ``recompute: full``. On CPU no allocator peak is read: the measurement says
so and the prediction is still given.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from disagg.gpucheck import inputs


def predicted_bytes(
    layout: Any, model_dir: Path, samples: list[dict[str, dict[str, torch.Tensor]]], precision: str
) -> dict[str, Any]:
    """Per module and in all, the cost model's bytes per rank for ``layout`` on ``samples``."""
    from disagg.cost import EncoderShape, predict
    from disagg.cost.shapes import shapes_for

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = shapes_for({"vision": cfg, "llm": cfg}, {"vision": inputs.FAMILY, "llm": inputs.FAMILY})
    vision = shapes["vision"]
    assert isinstance(vision, EncoderShape)
    grids = [g for s in samples if "vision" in s for g in s["vision"]["image_grid_thw"].tolist()]
    patches = [int(t * h * w) for t, h, w in grids]
    lengths = [int(s["llm"]["input_ids"].numel()) for s in samples]
    rows = sum(patches) // vision.unit
    out: dict[str, Any] = {}
    for module, (name, options) in (("vision", layout.vision), ("llm", layout.llm)):
        opts = {k: v for k, v in options.items() if k != "recompute"}
        if module == "vision":
            cost = predict(
                vision,
                name,
                1,
                1,
                round(sum(patches) / max(len(patches), 1)),
                precision,
                samples=max(len(patches), 1),
                options=opts,
                recompute="full",
            )
        else:
            cost = predict(
                shapes["llm"],
                name,
                1,
                1,
                round(sum(lengths) / len(lengths)),
                precision,
                samples=len(lengths),
                options=opts,
                recompute="full",
                exchanged_rows=round(rows / len(lengths)),
                exchanged_width=vision.out_hidden,
            )
        out[module] = int(cost.memory_bytes)
    out["total"] = out["vision"] + out["llm"]
    return out


@contextlib.contextmanager
def allocator_peak(device: torch.device) -> Iterator[dict[str, Any]]:
    """Within the block, the allocator's peak above what was allocated at its start; the dict
    yielded is filled on exit (``measured_bytes``: None on CPU, with why)."""
    rec: dict[str, Any] = {}
    if device.type != "cuda":
        rec.update(measured_bytes=None, measured="not available on cpu (no allocator peak to read)")
        yield rec
        return
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    try:
        yield rec
    finally:
        torch.cuda.synchronize(device)
        rec.update(
            measured_bytes=int(torch.cuda.max_memory_allocated(device) - base),
            allocated_before_bytes=int(base),
            measured="torch.cuda.max_memory_allocated over the layout's set-up and steps",
        )


def memory_record(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, Any]:
    """The layout's memory entry: both figures and measured ÷ predicted (None where not measured)."""
    m = measured.get("measured_bytes")
    return {
        **measured,
        "predicted_bytes": predicted,
        "measured_over_predicted": m / predicted["total"] if m is not None and predicted["total"] else None,
    }
