"""Turn an orchestrator step result into the ``metrics.jsonl`` record (its fields are
:data:`disagg.metrics.fields.FIELDS`), and a run's records into its summary."""

from __future__ import annotations

from typing import Any

from disagg.metrics.fields import EVAL_FIELDS, FIELDS, StepInputs
from disagg.metrics.record import StepResult


def step_record(
    step: int,
    res: StepResult,
    data_stats: dict[str, int],
    flops: dict[str, float] | None = None,
    peak_flops: float | None = None,
) -> dict[str, Any]:
    """Every field of :data:`~disagg.metrics.fields.FIELDS`, in its order: run-wide ones as
    numbers, per-group ones as ``{module: value}`` (a module whose value is unknown left out).
    ``flops``: per group, the step's model FLOPs (:mod:`disagg.metrics.flops`); ``peak_flops``:
    one device's peak FLOP/s in the run's precision (:mod:`disagg.metrics.peak`)."""
    x = StepInputs(step, res, data_stats, dict(flops or {}), peak_flops)
    out: dict[str, Any] = {}
    for f in FIELDS:
        if f.per == "step":
            out[f.name] = f.value(x)  # type: ignore[misc]
            continue
        values = {}
        for m in res.groups:
            v = res.groups[m][f.name] if f.reduce is not None else f.value(x, m)  # type: ignore[misc]
            if v is not None:
                values[m] = v
        out[f.name] = values
    return out


#: names a field had in older ``metrics.jsonl`` files -> its name now
RENAMED = {"group_time_s": "busy_s"}


def upgrade(record: dict[str, Any]) -> dict[str, Any]:
    """A record read from a ``metrics.jsonl`` under today's field names (a
    resumed or benchmarked run dir may hold lines an older version wrote)."""
    return {RENAMED.get(k, k): v for k, v in record.items()}


def eval_fields(ev: dict[str, Any]) -> dict[str, Any]:
    """The ``eval_*`` keys of a step's record (:data:`~disagg.metrics.fields.EVAL_FIELDS`), from
    ``Orchestrator.evaluate``."""
    return {f.name: f.value(ev) for f in EVAL_FIELDS}  # type: ignore[misc]


def summarize(records: list[dict[str, Any]], run_dir: str, status: str = "ok") -> dict[str, Any]:
    """``records``: the steps this invocation ran (a resumed run's start at its checkpoint).
    ``steps`` is the last step reached; ``steps_run`` how many of them this invocation ran,
    from ``first_step``."""
    if not records:
        return {"status": status, "steps": 0, "steps_run": 0, "run_dir": run_dir}
    tps = [r["tokens_per_s"] for r in records[1:]] or [records[0]["tokens_per_s"]]  # step 1 includes warm-up
    return {
        "status": status,
        "steps": records[-1]["step"],
        "steps_run": len(records),
        "first_step": records[0]["step"],
        "first_loss": records[0]["loss"],
        "last_loss": records[-1]["loss"],
        "mean_tokens_per_s": sum(tps) / len(tps),
        "skipped_samples": records[-1]["skipped_samples"],
        "dropped_too_long": records[-1]["dropped_too_long"],
        "truncated_too_long": records[-1].get("truncated_too_long", 0),
        "run_dir": run_dir,
        **_eval_summary(records),
    }


def _eval_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    evals = [(r["eval_loss"], r["step"]) for r in records if "eval_loss" in r]
    if not evals:
        return {}
    best = min(evals)
    return {"eval_loss": evals[-1][0], "best_eval_loss": best[0], "best_eval_step": best[1]}
