"""The planner on the published setting: Qwen2.5-VL-32B (config values from
``disagg.bench.published``), 8 x H100, the paper's vision lengths, full
activation recomputation (the paper's setting at these lengths)."""

from __future__ import annotations

from typing import Any

from disagg.plan.cluster import cluster_from
from disagg.plan.model import Layout, Workload
from disagg.plan.search import PlanResult, plan
from disagg.plugins import Registry

#: the paper's layouts, as (vision strategy, degree, replicas), (llm ...), with ZeRO at stage 3
NAMED = {
    "uniform_tp": (("megatron_tp", 8, 1), ("megatron_tp", 8, 1)),
    "dhp_ulysses_tp": (("ulysses", 8, 1), ("megatron_tp", 8, 1)),
    "uniform_zero3": (("zero", 1, 8), ("zero", 1, 8)),
}


def plan_published(vision_tokens: int, registry: Registry) -> PlanResult:
    from disagg.bench.published import QWEN2_5_VL_32B, SAMPLES, TEXT_TOKENS
    from disagg.interfaces.cost import shapes_from_hf_config

    work = Workload(
        shapes=shapes_from_hf_config(QWEN2_5_VL_32B),
        vision_tokens=vision_tokens,
        text_tokens=TEXT_TOKENS,
        samples=SAMPLES,
        recompute=True,
    )
    return plan(work, cluster_from("h100x8"), registry.strategies, placements=("collocated",))


def named(result: PlanResult, name: str) -> Layout:
    """The fastest variant (options such as sequence parallelism) of one of the
    paper's layouts, preferring one that fits."""
    (vs, vd, vr), (ls, ld, lr) = NAMED[name]

    def match(x: Layout) -> bool:
        v, llm = x.groups["vision"], x.groups["llm"]
        stages = [dict(g.options).get("stage", 3) for g in (v, llm) if g.strategy == "zero"]
        return (
            (v.strategy, v.degree, v.replicas) == (vs, vd, vr)
            and (llm.strategy, llm.degree, llm.replicas) == (ls, ld, lr)
            and all(s == 3 for s in stages)
        )

    found = [x for x in result.ranked + result.oom if match(x)]
    if not found:
        raise ValueError(f"layout {name} was not searched")
    return min(found, key=lambda x: (not x.fits, x.step_time_s))


def summary(result: PlanResult) -> dict[str, Any]:
    """Per length: the plan's choice, the paper's layouts' predicted time/memory/fit, DHP vs TP."""
    rows = {name: named(result, name) for name in NAMED}
    return {
        "vision_tokens": result.workload.vision_tokens,
        "best": result.best.name() if result.ranked else None,
        "layouts": {
            n: {
                "name": x.name(),
                "step_time_s": x.step_time_s,
                "memory_bytes": x.memory_bytes,
                "fits": x.fits,
            }
            for n, x in rows.items()
        },
        "speedup_dhp_vs_tp": rows["uniform_tp"].step_time_s / rows["dhp_ulysses_tp"].step_time_s,
    }
