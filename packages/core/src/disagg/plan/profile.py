"""``--profile``: a few real steps of the top candidates through ``disagg bench``'s
runner, then the candidates re-ranked by measured throughput."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from disagg.config.schema import Config
from disagg.plan.model import Layout
from disagg.plan.search import PlanResult
from disagg.plugins import Registry


def profile(
    result: PlanResult,
    base: Config,
    registry: Registry,
    *,
    top: int,
    steps: int,
    out_dir: Path,
    precision: str,
) -> list[Layout]:
    """Measure the ``top`` fitting layouts (``steps`` steps each, the first a
    warm-up) on the workload's vision length; return them fastest-measured
    first (a layout whose run failed goes last, its error kept)."""
    from disagg.bench.runner import Progress
    from disagg.bench.sweep import Bench

    chosen = result.ranked[:top]
    n = result.workload.vision_tokens
    progress = Progress(len(chosen))
    for k, layout in enumerate(chosen):
        name = f"p{k + 1}"
        cfg = base.model_copy(deep=True)
        cfg.train.schedule = layout.schedule
        bench = Bench(
            base=cfg,
            layouts={name: layout.parallel_section()},
            vision_tokens=[n],
            samples=result.workload.samples,
            steps=steps,
            precision=precision,
            out_dir=out_dir,
            registry=registry,
            progress=progress,
        )
        point = bench.run(name, [n])[0]
        if "measured" in point:
            m = point["measured"]
            layout.measured = {"tokens_per_s": m["tokens_per_s"], "step_time_s": m["step_time_s"]}
        else:
            layout.measured = {"tokens_per_s": 0.0, "step_time_s": float("inf"), "error": point.get("error")}
    return sorted(chosen, key=lambda x: -x.measured["tokens_per_s"])  # type: ignore[index]


def spearman(predicted: list[float], measured: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    if len(predicted) != len(measured) or len(predicted) < 2:
        raise ValueError("spearman needs two lists of the same length >= 2")

    def ranks(xs: list[float]) -> list[float]:
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    a, b = ranks(predicted), ranks(measured)
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    var = (sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b)) ** 0.5
    return cov / var if var else 0.0


def agreement(layouts: list[Layout]) -> dict[str, Any]:
    """Predicted vs measured step time of profiled layouts: the rank correlation and both orders."""
    done = [x for x in layouts if x.measured and "error" not in x.measured]
    pred = [x.step_time_s for x in done]
    meas = [x.measured["step_time_s"] for x in done]  # type: ignore[index]
    return {
        "spearman": spearman(pred, meas) if len(done) >= 2 else None,
        "predicted_order": [x.name() for x in sorted(done, key=lambda x: x.step_time_s)],
        "measured_order": [x.name() for x in sorted(done, key=lambda x: x.measured["step_time_s"])],  # type: ignore[index]
    }
