"""The planner's core: cluster descriptions, strategies' cost hooks (a third
party's included; one without a hook is skipped, not guessed), the memory
filter and the rank correlation. Pure computation, no actor."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import pytest

from disagg.builtin.ddp import DDPStrategy
from disagg.interfaces import Cost, CostQuery, Strategy, StrategyOptions, analytic_cost
from disagg.interfaces.cost import shapes_from_hf_config
from disagg.plan import Workload, cluster_from, plan
from disagg.plan.cluster import PRESETS, parse_quantity
from disagg.plan.explain import plan_yaml, table, why
from disagg.plan.profile import spearman

SMALL = {  # a small Qwen2.5-VL-like model, config values only
    "vision_config": {
        "depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "out_hidden_size": 96,
        "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 56,
        "fullatt_block_indexes": [3],
    },
    "text_config": {
        "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1000,
    },
}  # fmt: skip


class FusedDDP(Strategy):
    """A third party's data parallelism with (say) a fused kernel: ddp's bytes, half the FLOPs' time."""

    name: ClassVar[str] = "fused_ddp"
    distribution: ClassVar[str] = "disagg-fused"

    @classmethod
    def check(cls, family, degree, replicas, options):  # type: ignore[no-untyped-def]
        return [] if degree == 1 else ["degree must be 1"]

    @classmethod
    def estimate(cls, query: CostQuery, options: StrategyOptions) -> Cost | None:
        cost = analytic_cost("ddp", query)
        return replace(cost, flops=cost.flops / 2)

    def parallelize(self, module):  # type: ignore[no-untyped-def]
        return module


class Silent(Strategy):
    """A third party's strategy that implements no cost hook."""

    name: ClassVar[str] = "silent"

    def parallelize(self, module):  # type: ignore[no-untyped-def]
        return module


def work(**kw) -> Workload:  # type: ignore[no-untyped-def]
    return Workload(shapes=shapes_from_hf_config(SMALL), vision_tokens=1024, text_tokens=64, samples=4, **kw)


def test_third_party_hook_is_planned_and_a_silent_one_is_skipped():
    strategies = {"ddp": DDPStrategy, "fused_ddp": FusedDDP, "silent": Silent}
    result = plan(work(), cluster_from("h100x8", {"gpus": 4}), strategies)
    assert result.skipped == {"silent": "reports no cost (Strategy.estimate returns None)"}
    assert not any(g.strategy == "silent" for x in result.ranked + result.oom for g in x.groups.values())
    # half the compute time for the same bytes: the hook's figures decide the ranking
    assert {g.strategy for g in result.best.groups.values()} == {"fused_ddp"}
    ddp = result.find(vision="ddp", llm="ddp")
    assert ddp and ddp[0].step_time_s > result.best.step_time_s
    text = table(result, 3)
    assert "skipped: silent" in text and "fused_ddp(1x" in text
    best = result.best
    assert plan_yaml(best)["parallel"]["vision"] == {
        "strategy": "fused_ddp",
        "degree": 1,
        "replicas": best.groups["vision"].replicas,
    }
    assert plan_yaml(best)["train"]["microbatches"] == 4 // best.groups["vision"].replicas
    assert why(result)[0].startswith("best: vision=fused_ddp")


def test_memory_filter_and_placements():
    strategies = {"ddp": DDPStrategy}
    roomy = plan(work(), cluster_from("h100x8", {"gpus": 4}), strategies)
    assert {x.placement for x in roomy.ranked} == {"collocated", "disaggregated"}
    for x in roomy.ranked:
        ranks = [g.ranks for g in x.groups.values()]
        assert (max(ranks) if x.placement == "collocated" else sum(ranks)) <= 4
        mems = [c.memory_bytes for c in x.costs.values()]
        assert x.memory_bytes == (sum(mems) if x.placement == "collocated" else max(mems))
        # disaggregated groups with several microbatches overlap (encoders_ahead), collocated ones add up
        t = [sum(v.values()) for v in x.times.values()]
        if x.schedule == "encoders_ahead":
            assert x.step_time_s == pytest.approx(max(t) + min(t) / x.microbatches)
        else:
            assert x.step_time_s == pytest.approx(sum(t))
    need = min(x.memory_bytes for x in roomy.ranked)
    tight = plan(work(), cluster_from("h100x8", {"gpus": 4, "gpu_mem": need - 1}), strategies)
    assert not tight.ranked and tight.oom
    with pytest.raises(ValueError, match="no layout fits"):
        _ = tight.best


def test_recompute_keeps_less():
    shape = shapes_from_hf_config(SMALL)["llm"]
    q = CostQuery(shape, 2, 1, 4096)
    saved = analytic_cost("megatron_tp", q, {"sequence_parallel": True})
    again = analytic_cost("megatron_tp", replace(q, recompute=True), {"sequence_parallel": True})
    assert again.activation_bytes < saved.activation_bytes and again.state_bytes == saved.state_bytes
    assert PRESETS["h100x8"].devices == 8


def test_cluster_description():
    assert parse_quantity("80GiB", "x") == 80 * 2**30 and parse_quantity("80GB", "x") == 80e9
    assert parse_quantity("360GB/s", "x") == 360e9 and parse_quantity("989T", "x") == 989e12
    c = cluster_from("h200x8", {"gpus": "4", "gpu_mem": "141GB", "intra_bw": "900GB/s", "mfu": "0.5"})
    assert (c.devices, c.device_memory, c.intra_bw, c.mfu) == (4, 141e9, 900e9, 0.5)
    assert c.bandwidth(4) == 900e9 and cluster_from("h100x8", {"nodes": 2}).bandwidth(16) == 50e9
    with pytest.raises(ValueError, match="unknown preset 'a100'; allowed: h100x8, h200x8, cpu"):
        cluster_from("a100")
    with pytest.raises(ValueError, match="--gpu-mem: 'lots' is not a quantity"):
        cluster_from("h100x8", {"gpu_mem": "lots"})


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
