"""The planner on the published setting: Qwen2.5-VL-32B (config values from
``disagg.bench.published``), 8 x H100, the paper's vision lengths, full
activation recomputation (the paper's setting at these lengths)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from disagg.interfaces.lora import LoraSpec
from disagg.plan.cluster import Cluster, cluster_from
from disagg.plan.model import Layout, Workload
from disagg.plan.search import PlanResult, plan
from disagg.plugins import Registry


def published_shapes(config: dict[str, Any], registry: Registry | None = None) -> dict[str, Any]:
    """The published model's vision and LLM shapes from a whole-VLM ``config``'s values,
    as the published family (:data:`disagg.bench.published.FAMILY`) describes them."""
    from disagg.bench.published import FAMILY
    from disagg.cost.shapes import shapes_for

    return shapes_for({"vision": config, "llm": config}, {"vision": FAMILY, "llm": FAMILY}, registry)


def plan_published(
    vision_tokens: int,
    registry: Registry,
    cluster: Cluster | None = None,
    lora: dict[str, LoraSpec] | None = None,
    precision: str | None = None,
    modelled_keys: bool = True,
) -> PlanResult:
    """The plan on ``cluster`` (default the ``h100x8`` preset); ``lora``: module -> adapters
    (``train.modules.<m>.lora`` resolved), the rest of each module frozen; ``precision``: the
    ``train.precision`` recipe (None: the cluster's, ``bf16`` on ``h100x8``); ``modelled_keys``:
    search ``context_parallel`` and ``offload`` layouts by the cost model for the strategies
    :data:`disagg.bench.published.MODELLED` describes (:attr:`disagg.plan.model.Workload.modelled`)."""
    from disagg.bench.published import MODELLED, QWEN2_5_VL_32B, SAMPLES, TEXT_TOKENS

    work = Workload(
        shapes=published_shapes(QWEN2_5_VL_32B, registry),
        vision_tokens=vision_tokens,
        text_tokens=TEXT_TOKENS,
        samples=SAMPLES,
        recompute=True,
        lora=dict(lora or {}),
        precision=precision,
        modelled=dict(MODELLED) if modelled_keys else {},
    )
    return plan(work, cluster or cluster_from("h100x8"), registry.strategies, placements=("collocated",))


def named(result: PlanResult, name: str, keep: Callable[[Layout], bool] | None = None) -> Layout:
    """The fastest variant (options such as sequence parallelism) of one of the
    paper's layouts (:data:`disagg.bench.published.NAMED`), preferring one that fits;
    ``keep``: only variants it accepts (e.g. the same recompute in every module). The paper's
    layouts have no context parallelism and no offload: variants with either are never named."""
    from disagg.bench.published import NAMED
    from disagg.plan.extended import KEYS

    def accept(x: Layout) -> bool:
        if any(k in dict(g.options) for g in x.groups.values() for k in KEYS):
            return False
        return keep is None or keep(x)

    want = NAMED[name]

    def match(x: Layout) -> bool:
        return all(
            (g.strategy, g.degree, g.replicas) == want[m][:3]
            and all(dict(g.options).get(k, v) == v for k, v in want[m][3].items())
            for m, g in x.groups.items()
        )

    found = [x for x in result.ranked + result.oom if match(x) and accept(x)]
    if not found:
        raise ValueError(f"layout {name} was not searched")
    return min(found, key=lambda x: (not x.fits, x.step_time_s))


def summary(result: PlanResult) -> dict[str, Any]:
    """Per length: the plan's choice, the paper's layouts' predicted time/memory/fit, and the paper's
    own ratio DHP / uniform TP over its named layouts (each its fastest variant: not like for like,
    :mod:`disagg.bench.published_compare` is). Recorded by the cost change detector."""
    from disagg.bench.published import NAMED

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
