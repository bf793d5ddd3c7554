"""The planner's predicted step time vs the measured one (disagg bench's runner, as
`disagg plan --profile` runs it) for 5 layouts of the tiny Qwen2.5-VL on 2 CPU
"devices"; prints Spearman's rank correlation and both orders.

Usage (from a dir holding `tiny/` from `disagg make-tiny tiny` and the config
`tiny.yaml` of examples/bench/bench.yaml with paths under tiny/):
    python rank_correlation.py tiny.yaml [STEPS]
"""

import json
import sys
import time
from pathlib import Path

from disagg.config.load import load_config
from disagg.plan.cluster import cluster_from
from disagg.plan.profile import agreement, profile
from disagg.plan.search import plan
from disagg.plan.workload import config_families, config_workload
from disagg.plugins import get_registry

cfg = load_config(sys.argv[1], ["data.batch_size=2"])
reg = get_registry()
work = config_workload(cfg, vision_tokens=256, text_tokens=32)
res = plan(work, cluster_from("cpu", {"gpus": 2}), reg.strategies, config_families(cfg, reg), ("collocated",))
want = [
    (("ulysses", 2, 1, ()), ("megatron_tp", 2, 1, ())),
    (("megatron_tp", 2, 1, ()), ("megatron_tp", 2, 1, ())),
    (("ddp", 1, 2, ()), ("ddp", 1, 2, ())),
    (("ulysses", 2, 1, ()), ("ddp", 1, 2, ())),
    (("ddp", 1, 1, ()), ("ddp", 1, 1, ())),
]
chosen = []
for v, lm in want:
    for x in res.ranked:
        g = x.groups
        if (g["vision"].strategy, g["vision"].degree, g["vision"].replicas, g["vision"].options) == v and (
            g["llm"].strategy,
            g["llm"].degree,
            g["llm"].replicas,
            g["llm"].options,
        ) == lm:
            chosen.append(x)
            break
print("chosen", len(chosen))
res.ranked = sorted(chosen, key=lambda x: x.step_time_s)
t = time.time()
measured = profile(
    res,
    cfg,
    reg,
    top=len(chosen),
    steps=int(sys.argv[2]) if len(sys.argv) > 2 else 4,
    out_dir=Path("runs/rank_correlation"),
    dtype="float32",
)
a = agreement(measured)
rows = [
    {
        "layout": x.name(),
        "predicted_s": x.step_time_s,
        "measured_s": x.measured["step_time_s"],
        "tok_s": x.measured["tokens_per_s"],
    }
    for x in res.ranked
]
print(json.dumps({"rows": rows, **a, "wall_s": time.time() - t}, indent=1))
Path("rank_correlation.json").write_text(json.dumps({"rows": rows, **a}, indent=1))
