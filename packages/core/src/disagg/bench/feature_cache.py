"""``disagg bench CONFIG --feature-cache host|disk``: a frozen tower with its feature cache ÷ the
same layout without, measured and predicted.

Two runs of the config's own layout (``train.modules.vision.freeze: true`` set), two epochs each
over its ``data.train``: one with ``parallel.vision.feature_cache`` and one without. The figure
is epoch 2's median step time (the median: one slow step on a shared machine moves a mean of a
few steps a lot) (every tower output cached) with the cache ÷ without, beside the
planner's ratio for the same layout in the same steady state (:mod:`disagg.plan.feature_cache`
with the share encoded 0, on the ``cpu`` preset or ``--calibrate``'s cluster); and what a cached
sample costs: host bytes (``cache_bytes`` ÷ entries) and disk bytes (the files ÷ entries).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from disagg.config.schema import Config
from disagg.plugins import Registry

EPOCHS = 2


def cache_config(base: Config, cache: str, out: Path, steps: int) -> Config:
    """``base`` with a frozen tower, ``cache`` as its feature cache, ``steps`` steps, no checkpoints."""
    raw = base.model_dump(mode="json")
    vision = {k: v for k, v in raw["parallel"]["vision"].items() if not k.startswith("feature_cache")}
    if cache != "none":
        vision["feature_cache"] = cache
        if cache == "disk":
            vision["feature_cache_dir"] = str(out / "features")
    raw["parallel"]["vision"] = vision
    modules = raw["train"].get("modules") or {}
    modules["vision"] = {**(modules.get("vision") or {}), "freeze": True}
    raw["train"] = {**raw["train"], "modules": modules, "steps": steps, "epochs": None}
    raw["data"] = {**raw["data"], "shuffle": False, "eval": None}
    raw["checkpoint"] = {**raw["checkpoint"], "every": 0, "resume_from": None}
    raw["output_dir"] = str(out)
    return Config.model_validate(raw)


def epoch_steps(cfg: Config) -> int:
    from disagg.data.files import dataset_files, index_file

    assert cfg.data is not None
    samples = sum(index_file(f).size for f in dataset_files(cfg, "train"))
    return max(1, math.ceil(samples / cfg.data.batch_size))


def run_cache_bench(
    base: Config, caches: list[str], out_dir: Path, registry: Registry, cluster: Any = None
) -> dict[str, Any]:
    """The uncached run and one per cache kind, measured and predicted; written to
    ``out_dir/feature_cache.{json,md}``."""
    from disagg.bench.versus import machine_load
    from disagg.config.validate import validate
    from disagg.runtime.run import run_training

    if base.model.vision is None:
        raise ValueError("--feature-cache benches a frozen vision tower: the config needs model.vision")
    per_epoch = epoch_steps(base)
    epoch2 = slice(per_epoch, 2 * per_epoch)
    runs: dict[str, list[dict[str, Any]]] = {}
    load = [machine_load()]
    for kind in ("none", *caches):
        run_dir = out_dir / f"cache-{kind}"
        cfg = cache_config(base, kind, run_dir, EPOCHS * per_epoch)
        run_training(validate(cfg, registry), progress=False)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        runs[kind] = [r for r in map(json.loads, lines) if "loss" in r]
    step = {k: statistics.median(r["step_time_s"] for r in v[epoch2]) for k, v in runs.items()}
    calls = {k: sum(r["encode_calls_per_rank"]["vision"] for r in v[epoch2]) for k, v in runs.items()}
    ref = cache_config(base, caches[0], out_dir / "predict", per_epoch)
    result: dict[str, Any] = {
        "steps_per_epoch": per_epoch,
        "machine_load": {"start": load[0], "end": machine_load()},
        "epoch2_step_time_s": step,
        "epoch2_step_times_s": {k: [r["step_time_s"] for r in v[epoch2]] for k, v in runs.items()},
        "epoch2_encode_calls_per_rank": calls,
        "predicted": predicted(ref, registry, cluster),
        "caches": {},
    }
    for kind in caches:
        got = runs[kind]
        entries = sum(r["cache_misses"]["vision"] for r in got)  # each miss stores one (none evicted)
        row: dict[str, Any] = {"measured_ratio": step[kind] / step["none"], "entries": entries}
        if kind == "host":
            row["host_bytes_per_sample"] = got[-1]["cache_bytes"]["vision"] / entries
        else:
            files = [f for f in (out_dir / f"cache-{kind}" / "features").rglob("*") if f.is_file()]
            row["disk_bytes_per_sample"] = sum(f.stat().st_size for f in files) / entries
        result["caches"][kind] = row
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "feature_cache.json").write_text(json.dumps(result, indent=1))
    (out_dir / "feature_cache.md").write_text(markdown(result))
    return result


def data_tokens(cfg: Config, registry: Registry) -> tuple[int, int]:
    """Mean vision tokens (merged rows the LLM sees) and text tokens per sample of ``data.train``
    (``disagg data check``'s figures), the workload the prediction assumes."""
    from disagg.data.check import check_data
    from disagg.runtime.plan import families_for

    report = check_data(cfg, families_for(cfg, registry), progress=False)
    total = report["tokens"]["mean"]
    vision = report["media_tokens"].get("vision", {"samples": 0})
    rows = vision["mean"] * vision["samples"] / report["ok"] if vision["samples"] else 0.0
    return max(1, round(rows)), max(1, round(total - rows))


def predicted(cfg: Config, registry: Registry, cluster: Any = None) -> dict[str, Any]:
    """The planner's step time of ``cfg``'s layout with every tower output cached (epoch 2) and
    without, and their ratio, for the data's mean sample. The time model gets as many devices as
    the layout takes (as :meth:`disagg.bench.sweep.Bench.predict_step_time` does)."""
    from dataclasses import replace

    from disagg.plan.cluster import PRESETS
    from disagg.plan.own import own_layout
    from disagg.plan.workload import config_workload

    cluster = cluster if cluster is not None else PRESETS["cpu"]
    groups = [getattr(cfg.parallel, m) for m in cfg.modules()]
    ranks = [g.degree * g.context_parallel * g.replicas for g in groups]
    need = sum(ranks) if cfg.parallel.placement == "disaggregated" else max(ranks)
    if cluster.devices < need:
        cluster = replace(cluster, devices_per_node=need, nodes=1)
    rows, text = data_tokens(cfg, registry)
    work = config_workload(cfg, vision_tokens=rows, text_tokens=text, registry=registry)
    times = {}
    for name, encoded in (("cached", {"vision": 0.0}), ("uncached", {})):
        own = own_layout(cfg, replace(work, encoded=encoded), cluster, registry.strategies)
        if own.layout is None:
            return {"ratio": None, "why": own.why}
        times[name] = own.layout.step_time_s
    return {
        "step_time_s": times,
        "ratio": times["cached"] / times["uncached"],
        "cluster": cluster.name,
        "vision_tokens": rows,
        "text_tokens": text,
    }


def markdown(r: dict[str, Any]) -> str:
    p, step, calls = r["predicted"], r["epoch2_step_time_s"], r["epoch2_encode_calls_per_rank"]
    rows = [
        "| run | epoch-2 step time, median (s) | ÷ uncached, measured | ÷ uncached, predicted | "
        "tower calls/rank, epoch 2 | per cached sample |",
        "|---|---|---|---|---|---|",
        f"| uncached | {step['none']:.4f} | 1 | 1 | {calls['none']} | |",
    ]
    ratio = "n/a" if p["ratio"] is None else f"{p['ratio']:.3f}"
    for kind, c in r["caches"].items():
        size = c.get("host_bytes_per_sample", c.get("disk_bytes_per_sample"))
        where = "host" if "host_bytes_per_sample" in c else "disk"
        rows.append(
            f"| {kind} | {step[kind]:.4f} | **{c['measured_ratio']:.3f}** | {ratio} | {calls[kind]} | "
            f"{where} {size / 1024:.1f} KiB ({c['entries']} entries) |"
        )
    why = (
        f"predicted: the planner's model on the `{p['cluster']}` time model, {p['vision_tokens']} vision + "
        f"{p['text_tokens']} text tokens per sample (the data's means); every tower output cached"
        if p["ratio"] is not None
        else f"no prediction: {p['why']}"
    )
    load = r["machine_load"]
    why += (
        f"; load average {load['start']['loadavg_1_5_15'][0]} → {load['end']['loadavg_1_5_15'][0]} "
        f"on {load['start']['cores']} cores"
    )
    return (
        f"# Frozen tower with a feature cache ÷ without, epoch 2 ({r['steps_per_epoch']} steps per epoch)\n\n"
        + "\n".join(rows)
        + f"\n\n{why}.\n"
    )
