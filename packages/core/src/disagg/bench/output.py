"""Everything a bench leaves in its run dir: ``bench.json``, ``bench.md``, the plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disagg.bench import published
from disagg.bench.plots import plot
from disagg.bench.report import points_table, published_md, targets, targets_md
from disagg.bench.versus import machine, machine_load, versus_md, versus_rows

MEMORY_NOTE = (
    "Memory per rank is saved-activation bytes (autograd's saved tensors) + parameter, gradient and "
    "optimizer bytes, summed over collocated groups: the machine-independent figure. The budget search "
    "uses it, not the process's RSS (shown for reference)."
)


def write_outputs(
    bench: Any,
    search: dict[str, Any] | None,
    degree: int,
    predict_lengths: list[int],
    usable: float = 1.0,
    calibration: Any = None,
) -> dict[str, Any]:
    """``usable``: the fraction of the published setting's 80 GB a predicted layout may fill;
    ``calibration``: a :class:`~disagg.plan.cluster.Cluster` the prediction uses in place of its preset."""
    out: Path = bench.out_dir
    probes = [p for s in (search or {}).values() for p in s["probes"]]
    host = {
        **machine(),
        "load_start": getattr(bench, "load_start", None) or machine_load(),
        "load_end": machine_load(),
    }
    cluster = bench.time_model()
    time_model = {"name": cluster.name, "source": cluster.source, "cluster": cluster.to_dict()}
    versus = versus_rows(bench.points + probes)
    result: dict[str, Any] = {
        "config": {
            "precision": bench.precision,
            "samples_per_step": bench.samples,
            "steps": bench.steps,
            "seed": bench.base.train.seed,
            "placement": bench.placement,
            "vision_tokens": bench.vision_tokens,
            "mem_budget_bytes": bench.budget,
        },
        "layouts": bench.layouts,
        "machine": host,
        "time_model": time_model,
        "predicted_vs_measured": versus,
        "memory_note": MEMORY_NOTE,
        "points": bench.points,
        "budget_search": (
            {k: {kk: vv for kk, vv in v.items() if kk != "probes"} for k, v in search.items()}
            if search
            else None
        ),
        "budget_probes": probes,
        "targets": targets(bench.points, degree, search),
    }
    md = [
        "# disagg bench",
        "",
        f"precision {bench.precision}, {bench.samples} samples/step (one image each), "
        f"{bench.steps} steps/point "
        f"(median after the first), seed {bench.base.train.seed}, placement {bench.placement}.",
        "Measured figures, analytic prediction in parentheses with the relative error.",
        "",
        points_table(bench.points, bench.budget),
        "",
        MEMORY_NOTE,
        "",
        "## Targets",
        "",
        targets_md(result["targets"]),
    ]
    if probes:
        md += ["", "## Budget probes", "", points_table(probes, bench.budget)]
    versus_text = versus_md(versus, time_model, host)
    md += ["", "#" + versus_text]  # a section of bench.md, and a page of its own
    if predict_lengths:
        from disagg.bench.published_fit import fit_md, fit_table

        rows = published.predict_published(predict_lengths, usable=usable, machine=calibration)
        ratios = published.ratios(rows)
        budget = published.usable_bytes(usable)
        fits = fit_table(budget, bench.registry.strategies if bench.registry is not None else None)
        result["published_prediction"] = {
            "model": "Qwen2.5-VL-32B (config values)",
            "assumptions": published.__doc__,
            "paper": published.PAPER,
            "usable_bytes_per_gpu": budget,
            "rows": rows,
            "ratios": ratios,
            "longest_fit": [f.to_dict() for f in fits],
        }
        md += [
            "",
            "## Predicted: Qwen2.5-VL-32B on 8 x H100 80 GB (paper's figures beside)",
            "",
            published_md(rows, ratios, published.PAPER),
            "",
            fit_md(fits, budget, published.PAPER),
        ]
    pngs = plot(bench.points, out, bench.budget, probes)
    json_path, md_path = out / "bench.json", out / "bench.md"
    json_path.write_text(json.dumps(result, indent=2, default=str))
    md_path.write_text("\n".join(md) + "\n")
    versus_json, versus_path = out / "versus.json", out / "versus.md"
    versus_json.write_text(
        json.dumps({"machine": host, "time_model": time_model, "rows": versus}, indent=2, default=str)
    )
    versus_path.write_text(versus_text + "\n")
    return {
        "json": json_path,
        "markdown": md_path,
        "versus_json": versus_json,
        "versus_markdown": versus_path,
        "throughput_png": pngs[0],
        "memory_png": pngs[1],
        "table_text": "\n".join(md),
    }
