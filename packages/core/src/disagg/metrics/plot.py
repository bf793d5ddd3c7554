"""``disagg plot``: a run's ``metrics.jsonl`` as PNGs (matplotlib, files only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disagg.metrics.step import upgrade

INSTALL_HINT = "disagg plot draws with matplotlib: pip install 'disagg-core[bench]'"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records of ``metrics.jsonl`` (event lines, such as restarts, left out);
    a step logged twice (a resumed run) keeps its last record."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "step" in row and "event" not in row:
                by_step[int(row["step"])] = upgrade(row)
    return [by_step[s] for s in sorted(by_step)]


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write ``loss.png`` (train loss, and eval loss where the run evaluated),
    ``throughput.png`` (tokens/s), ``memory.png`` (peak memory per module) and
    ``modules.png`` (per module: FLOPs per step, MFU, active tokens/s per device and
    idle fraction, where the run logged them); return their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a CI machine
    import matplotlib.pyplot as plt

    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    if not rows:
        raise ValueError(f"{Path(run_dir) / 'metrics.jsonl'} has no step records")
    out_dir = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]
    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(out_dir / name)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r["loss"] for r in rows], label="train loss")
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if evals:
        ax.plot(*zip(*evals), marker="o", label="eval loss")
    ax.set(xlabel="step", ylabel="loss (per label token)", title="loss")
    ax.legend()
    save(fig, "loss.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r["tokens_per_s"] for r in rows])
    ax.set(xlabel="step", ylabel="tokens / s", title="throughput")
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for module in rows[0].get("peak_mem_bytes", {}):
        ax.plot(steps, [r["peak_mem_bytes"][module] / 2**20 for r in rows], label=module)
    ax.set(xlabel="step", ylabel="peak memory per rank (MiB)", title="memory")
    ax.legend()
    save(fig, "memory.png")

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for ax, (key, label, scale) in zip(axes.flat, MODULE_PANELS):
        for module in sorted({m for r in rows for m in r.get(key, {})}):
            pts = [(r["step"], r[key][module] * scale) for r in rows if module in r.get(key, {})]
            ax.plot(*zip(*pts), label=module)
        ax.set(xlabel="step", ylabel=label, title=key)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    save(fig, "modules.png")
    return written


#: ``modules.png``'s panels: record field, axis label, scale
MODULE_PANELS = (
    ("flops", "model TFLOPs per step", 1e-12),
    ("mfu", "MFU (fraction of peak)", 1.0),
    ("active_tokens_per_s_per_device", "active tokens / s / device", 1.0),
    ("idle_fraction", "idle fraction of the step", 1.0),
)
