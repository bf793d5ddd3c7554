"""Benchmark: does ``encoders_ahead`` hide the encoders behind the LLM?

Trains the tiny Qwen2.5-VL twice in one process, same data, seed and layout
(``disaggregated`` placement, ulysses 2 vision + megatron_tp 2 LLM,
``microbatches: 4``), once per schedule, and reports per schedule the LLM
group's ``wait_s`` (time blocked on the vision group) and the step time, as
medians over the steps after the first (warm-up). A benchmark, not a test:
it prints figures and writes ``schedule_overlap.json``; nothing is asserted.

    python examples/bench/schedule_overlap.py [OUT_DIR] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from disagg.cli.make_tiny import make_tiny
from disagg.config.schema import Config
from disagg.config.validate import validate
from disagg.plugins import get_registry
from disagg.runtime.run import run_training


def _config(tiny: dict, out: Path, schedule: str, steps: int) -> Config:
    path = tiny["models"]["qwen2_5_vl"]
    return Config.model_validate(
        {
            "model": {
                "vision": {"family": "qwen2_5_vl", "path": path},
                "llm": {"family": "qwen2_5_vl", "path": path},
            },
            "parallel": {
                "placement": "disaggregated",
                "vision": {"strategy": "ulysses", "degree": 2},
                "llm": {"strategy": "megatron_tp", "degree": 2},
            },
            "data": {"train": tiny["data"]["train"], "media_root": tiny["media_root"], "batch_size": 8},
            "train": {"steps": steps, "microbatches": 4, "schedule": schedule, "max_inflight": 2, "seed": 0},
            "checkpoint": {"every": 0},
            "output_dir": str(out / schedule),
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="runs/schedule_overlap")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    out = Path(args.out)
    tiny = make_tiny(out / "tiny", ["qwen2_5_vl"], train_per_class=2, image_size=64)
    result = {}
    for schedule in ("sequential", "encoders_ahead"):
        cfg = _config(tiny, out, schedule, args.steps)
        run_training(validate(cfg, get_registry()), progress=False)
        rows = [json.loads(x) for x in (out / schedule / "metrics.jsonl").read_text().splitlines()][1:]
        result[schedule] = {
            "llm_wait_s": statistics.median(r["wait_s"]["llm"] for r in rows),
            "vision_wait_s": statistics.median(r["wait_s"]["vision"] for r in rows),
            "step_time_s": statistics.median(r["step_time_s"] for r in rows),
            "losses": [r["loss"] for r in rows],
        }
    seq, ahead = result["sequential"], result["encoders_ahead"]
    result["ratios"] = {
        "llm_wait_ahead_over_sequential": ahead["llm_wait_s"] / max(seq["llm_wait_s"], 1e-9),
        "step_time_ahead_over_sequential": ahead["step_time_s"] / seq["step_time_s"],
    }
    (out / "schedule_overlap.json").write_text(json.dumps(result, indent=2))
    print("| schedule | LLM wait_s | vision wait_s | step time s |")
    print("|---|---|---|---|")
    for name in ("sequential", "encoders_ahead"):
        r = result[name]
        print(f"| {name} | {r['llm_wait_s']:.3f} | {r['vision_wait_s']:.3f} | {r['step_time_s']:.3f} |")
    print(json.dumps(result["ratios"]))


if __name__ == "__main__":
    main()
