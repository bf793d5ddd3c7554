"""Run every variant on the same config, data and seed; summarize as ratios."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from disagg.config.schema import Config
from disagg.plugins import Registry
from disagg.runtime.run import run_training


def run_variants(
    base: Config, variants: dict[str, dict[str, Any]], registry: Registry, out_dir: Path
) -> list[dict[str, Any]]:
    rows = []
    for name, parallel in variants.items():
        raw = base.model_dump(mode="json")
        raw["parallel"] = {
            **{k: v for k, v in raw["parallel"].items() if k in ("placement", "transport")},
            **parallel,
        }
        raw["output_dir"] = str(out_dir / name)
        raw["checkpoint"] = {"every": 0}
        cfg = Config.model_validate(raw)
        from disagg.config.validate import validate

        validate(cfg, registry)
        run_training(cfg, registry=registry, progress=False)
        records = [json.loads(x) for x in (out_dir / name / "metrics.jsonl").read_text().splitlines()]
        rows.append(summarize(name, records))
    base_tps = rows[0]["tokens_per_s"]
    for r in rows:
        r["throughput_vs_" + rows[0]["variant"]] = r["tokens_per_s"] / base_tps if base_tps else None
    return rows


def summarize(name: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    timed = records[1:] or records  # the first step pays for warm-up
    return {
        "variant": name,
        "steps": len(records),
        "final_loss": records[-1]["loss"],
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "comm_bytes_per_rank": timed[-1]["comm_bytes_per_rank"],
        "activation_bytes_per_rank": timed[-1]["activation_bytes_per_rank"],
        "state_bytes_per_rank": timed[-1]["state_bytes_per_rank"],
        "peak_mem_bytes": timed[-1]["peak_mem_bytes"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]["variant"]
    lines = [
        f"{'variant':<18} {'tok/s x' + base:>22} {'comm B/rank':>24} "
        f"{'activ B/rank':>26} {'state B/rank':>26}"
    ]
    for r in rows:

        def fmt(d: dict[str, int]) -> str:
            return ",".join(f"{k}={v}" for k, v in sorted(d.items()))

        lines.append(
            f"{r['variant']:<18} {r['throughput_vs_' + base]:>22.3f} {fmt(r['comm_bytes_per_rank']):>24} "
            f"{fmt(r['activation_bytes_per_rank']):>26} {fmt(r['state_bytes_per_rank']):>26}"
        )
    return "\n".join(lines)
