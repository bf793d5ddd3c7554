"""The planner's predicted step time vs the measured one (disagg bench's runner, as
`disagg plan --profile` runs it) for 7 layouts of the tiny Qwen2.5-VL on 2 CPU
"devices", collocated and disaggregated, ddp / ulysses / megatron_tp / ZeRO-3;
prints Spearman's rank correlation and both orders.

Two steps, so the (slow, load-sensitive) measurement runs once and the
prediction can be recomputed from it with any cluster description:

    # from a dir holding `runs/bench/tiny` (`disagg make-tiny runs/bench/tiny`) and
    # a config naming it (examples/bench/bench.yaml does)
    python rank_correlation.py measure examples/bench/bench.yaml [STEPS]   # -> rank_correlation.json
    python rank_correlation.py compare examples/bench/bench.yaml rank_correlation.json [CLUSTER_JSON]

``measure`` runs the layouts (``disagg plan --profile``'s runner), then
calibrates this machine in the same Ray session, under the same load (matmul,
layer dispatch, gloo all-reduce, Ray actor call: ``disagg plan --calibrate``)
and writes both; ``compare`` plans the same workload on that cluster (or the
one in CLUSTER_JSON) and ranks the measured layouts by the prediction.
"""

import json
import os
import sys
import time
from pathlib import Path

from disagg.config.load import load_config
from disagg.plan.calibrate import calibrate
from disagg.plan.cluster import PRESETS, Cluster, cluster_from, load_cluster
from disagg.plan.profile import agreement, profile, spearman
from disagg.plan.search import plan
from disagg.plan.workload import config_families, config_workload
from disagg.plugins import get_registry

#: (vision (strategy, degree, replicas, options), llm (...), placement)
WANT = [
    (("ulysses", 2, 1, ()), ("megatron_tp", 2, 1, ()), "collocated"),
    (("megatron_tp", 2, 1, ()), ("megatron_tp", 2, 1, ()), "collocated"),
    (("ddp", 1, 2, ()), ("ddp", 1, 2, ()), "collocated"),
    (("ulysses", 2, 1, ()), ("ddp", 1, 2, ()), "collocated"),
    (("ddp", 1, 1, ()), ("ddp", 1, 1, ()), "collocated"),
    (("ddp", 1, 1, ()), ("ddp", 1, 1, ()), "disaggregated"),
    (("zero", 1, 2, (("stage", 3),)), ("zero", 1, 2, (("stage", 3),)), "collocated"),
]


def key(x):  # type: ignore[no-untyped-def]
    g = x.groups
    return tuple((g[m].strategy, g[m].degree, g[m].replicas, g[m].options) for m in ("vision", "llm")) + (
        x.placement,
    )


def planned(config: str, cluster):  # type: ignore[no-untyped-def]
    cfg = load_config(config, ["data.batch_size=2"])
    reg = get_registry()
    work = config_workload(cfg, vision_patches=256, text_tokens=32)
    res = plan(work, cluster, reg.strategies, config_families(cfg, reg))
    by_key = {key(x): x for x in res.ranked}
    chosen = [by_key[(v, lm, p)] for v, lm, p in WANT if (v, lm, p) in by_key]
    return cfg, reg, res, chosen


def measure(config: str, steps: int) -> None:
    cfg, reg, res, chosen = planned(config, cluster_from("cpu-local", {"gpus": 2}))
    print("chosen", len(chosen), "of", len(WANT))
    res.ranked = sorted(chosen, key=lambda x: x.step_time_s)
    load_before, t = os.getloadavg(), time.time()
    measured = profile(
        res, cfg, reg, top=len(chosen), steps=steps, out_dir=Path("runs/rank_correlation"), precision="fp32"
    )
    rows = [
        {"layout": x.name(), "key": repr(key(x)), **x.measured}  # type: ignore[dict-item]
        for x in measured
    ]
    out = {
        "command": " ".join(sys.argv),
        "steps": steps,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "wall_s": time.time() - t,
        "rows": rows,
        "at_measurement": agreement(measured),
    }
    Path("rank_correlation.json").write_text(json.dumps(out, indent=1))  # kept if calibration fails
    machine = cluster_from(calibrate(PRESETS["cpu"], name="cpu-local", ray_calls=True), {"gpus": 2})
    out["cluster"] = machine.to_dict()
    print(json.dumps(out, indent=1))
    Path("rank_correlation.json").write_text(json.dumps(out, indent=1))
    compare(config, "rank_correlation.json", None)


def compare(config: str, measured_json: str, cluster_json: str | None) -> None:
    record = json.loads(Path(measured_json).read_text())
    if cluster_json:
        cluster = load_cluster(cluster_json)
    elif "cluster" in record:
        cluster = Cluster(**record["cluster"])
    else:
        cluster = cluster_from("cpu-local", {"gpus": 2})
    _, _, _, chosen = planned(config, cluster)
    got = {r["key"]: r for r in record["rows"] if "error" not in r}
    rows = [(x, got[repr(key(x))]["step_time_s"]) for x in chosen if repr(key(x)) in got]
    pred = [x.step_time_s for x, _ in rows]
    meas = [m for _, m in rows]
    print(cluster.describe())
    print(f"{'layout':<80} {'predicted s':>11} {'measured s':>10} {'pred rank':>9} {'meas rank':>9}")
    prank = {id(x): k for k, (x, _) in enumerate(sorted(rows, key=lambda r: r[0].step_time_s), 1)}
    mrank = {id(x): k for k, (x, _) in enumerate(sorted(rows, key=lambda r: r[1]), 1)}
    for x, m in rows:
        print(f"{x.name():<80} {x.step_time_s:>11.4f} {m:>10.4f} {prank[id(x)]:>9} {mrank[id(x)]:>9}")
    print(f"spearman = {spearman(pred, meas):.3f} over {len(rows)} layouts")


if __name__ == "__main__":
    if sys.argv[1] == "measure":
        measure(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 4)
    else:
        compare(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
