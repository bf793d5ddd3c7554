"""``parallel: auto``: plan before training, train the best layout, record the choice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disagg.config.schema import Config
from disagg.plugins import Registry


def resolve_auto(cfg: Config, registry: Registry) -> tuple[Config, dict[str, Any]]:
    """``cfg`` with the planner's best layout in place of ``parallel.auto`` (groups,
    placement, ``train.microbatches`` and ``train.schedule``), and the record of
    the choice. A config without ``parallel.auto`` comes back unchanged."""
    auto = cfg.parallel.auto
    if auto is None:
        return cfg, {}
    from disagg.config.errors import ConfigError, Problem

    try:
        return _resolve(cfg, registry)
    except ValueError as exc:  # a model dir without a shape, a bad preset, nothing fits
        raise ConfigError([Problem("parallel.auto", str(exc))]) from None


def _resolve(cfg: Config, registry: Registry) -> tuple[Config, dict[str, Any]]:
    from disagg.plan.cluster import cluster_from
    from disagg.plan.explain import plan_yaml, why
    from disagg.plan.feature_cache import user_cache_keys
    from disagg.plan.search import PLACEMENTS, plan
    from disagg.plan.workload import config_families, config_workload

    auto = cfg.parallel.auto
    assert auto is not None
    if auto.cluster is None:
        from disagg.runtime.run import ensure_ray

        ensure_ray(cfg.ray.address, cfg.ray.num_cpus)
        import ray

        preset = "h100x8" if ray.cluster_resources().get("GPU", 0) else "cpu"
        cluster = cluster_from(preset, ray_cluster=True)
    else:
        cluster = cluster_from(auto.cluster)
    work = config_workload(
        cfg, vision_tokens=auto.vision_tokens, text_tokens=auto.text_tokens, recompute=auto.recompute
    )
    placements = PLACEMENTS if auto.placement == "any" else (auto.placement,)
    strategies = registry.strategies
    if auto.strategies is not None:
        unknown = sorted(set(auto.strategies) - set(strategies))
        if unknown:
            raise ValueError(
                f"strategies {unknown} are not installed; allowed: {', '.join(sorted(strategies))}"
            )
        strategies = {n: c for n, c in strategies.items() if n in auto.strategies}
    # the best and the top five: a layout a less-offloaded twin beats is neither (prune); tiles
    # where nothing fits without them
    families = config_families(cfg, registry)
    result = plan(work, cluster, strategies, families, placements, prune=True, tiles=True)
    best = result.best
    chosen = plan_yaml(best)
    raw = cfg.model_dump(mode="json")
    settings = {k: v for k, v in raw["parallel"].items() if k not in ("vision", "audio", "llm", "auto")}
    raw["parallel"] = {**settings, **chosen["parallel"]}
    for m, keys in user_cache_keys(cfg).items():  # the user's, not the planner's to choose
        raw["parallel"][m] = {**raw["parallel"][m], **keys}
    raw["train"] = {**raw["train"], **chosen["train"]}
    record = {
        "cluster": cluster.to_dict(),
        "auto": auto.model_dump(mode="json"),
        "chosen": chosen,
        "predicted": {"step_time_s": best.step_time_s, "memory_bytes": best.memory_bytes},
        "why": why(result),
        "top": [x.to_dict() for x in result.ranked[:5]],
        "skipped": result.skipped,
    }
    return Config.model_validate(raw), record


def record_plan(run_dir: str | Path, record: dict[str, Any]) -> Path:
    """``RUN_DIR/plan.json``: what ``parallel: auto`` chose and why."""
    path = Path(run_dir) / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return path
