"""Turn an orchestrator step result into the ``metrics.jsonl`` record."""

from __future__ import annotations

from typing import Any

from disagg.metrics.record import StepResult, per_gpu


def step_record(step: int, res: StepResult, data_stats: dict[str, int]) -> dict[str, Any]:
    """The fields every ``metrics.jsonl`` line carries, plus per-group detail."""
    return {
        "step": step,
        "loss": res.loss,
        "grad_norm": res.grad_norm,
        "step_time_s": res.step_time_s,
        "tokens_per_s": res.tokens / res.step_time_s if res.step_time_s > 0 else 0.0,
        "tokens": res.tokens,
        "label_tokens": res.label_tokens,
        "module_tokens": dict(res.module_tokens),
        "peak_mem_bytes": {m: g["peak_mem_bytes"] for m, g in res.groups.items()},
        "peak_reserved_bytes": {m: g["peak_reserved_bytes"] for m, g in res.groups.items()},
        # CUDA: per GPU, the reserved peaks of the processes on it summed, and its used memory
        "gpu_mem_bytes": per_gpu(res.records),
        # CUDA: GPU time of the slowest rank (CUDA events); busy_s is host time
        "device_s": {m: g["device_s"] for m, g in res.groups.items()},
        "comm_bytes": {m: g["comm_bytes"] for m, g in res.groups.items()},
        "comm_bytes_per_rank": {m: g["comm_bytes_per_rank"] for m, g in res.groups.items()},
        # the most any rank of the group sent, by collective kind / to other groups
        "collective_bytes_per_rank": {m: g["collective_bytes_per_rank"] for m, g in res.groups.items()},
        "collective_calls_per_rank": {m: g["collective_calls_per_rank"] for m, g in res.groups.items()},
        "overlapped_calls_per_rank": {m: g["overlapped_calls_per_rank"] for m, g in res.groups.items()},
        "sent_bytes_per_rank": {m: g["sent_bytes_per_rank"] for m, g in res.groups.items()},
        "busy_s": {m: g["busy_s"] for m, g in res.groups.items()},
        # time each group spent blocked on another (shards or gradients not yet there)
        "wait_s": {m: g["wait_s"] for m, g in res.groups.items()},
        "activation_bytes_per_rank": {m: g["activation_bytes_per_rank"] for m, g in res.groups.items()},
        "state_bytes_per_rank": {m: g["state_bytes_per_rank"] for m, g in res.groups.items()},
        "lr": {m: g["lr"] for m, g in res.groups.items()},
        "skipped_samples": int(data_stats.get("skipped", 0)),
        "dropped_too_long": int(data_stats.get("dropped_too_long", 0)),
        "truncated_too_long": int(data_stats.get("truncated", 0)),
    }


#: names a field had in older ``metrics.jsonl`` files -> its name now
RENAMED = {"group_time_s": "busy_s"}


def upgrade(record: dict[str, Any]) -> dict[str, Any]:
    """A record read from a ``metrics.jsonl`` under today's field names (a
    resumed or benchmarked run dir may hold lines an older version wrote)."""
    return {RENAMED.get(k, k): v for k, v in record.items()}


def eval_fields(ev: dict[str, Any]) -> dict[str, Any]:
    """The ``eval_*`` keys of a step's record, from ``Orchestrator.evaluate``."""
    return {
        "eval_loss": ev["loss"],
        "eval_token_accuracy": ev["token_accuracy"],
        "eval_label_tokens": ev["label_tokens"],
        "eval_samples": ev["samples"],
        "eval_module_tokens": dict(ev["tokens"]),
        "eval_time_s": ev["time_s"],
    }


def summarize(records: list[dict[str, Any]], run_dir: str, status: str = "ok") -> dict[str, Any]:
    if not records:
        return {"status": status, "steps": 0, "run_dir": run_dir}
    tps = [r["tokens_per_s"] for r in records[1:]] or [records[0]["tokens_per_s"]]  # step 1 includes warm-up
    return {
        "status": status,
        "steps": records[-1]["step"],
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
