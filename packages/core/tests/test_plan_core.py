"""The planner's core: cluster descriptions, strategies' cost hooks (a third
party's included; one without a hook is skipped, not guessed), the memory
filter and the rank correlation. Pure computation, no actor."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import pytest

from disagg.builtin.ddp import DDPStrategy
from disagg.cost import predict, shapes_for
from disagg.interfaces import Cost, CostQuery, StrategyOptions
from disagg.kit import Strategy
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


def shapes_from_hf_config(cfg: dict) -> dict:
    """SMALL's modules as the ``qwen2_5_vl`` families (disagg-vision-sp, disagg-llm-tp) describe them."""
    pytest.importorskip("disagg_vision_sp")
    pytest.importorskip("disagg_llm_tp")
    return shapes_for({"vision": cfg, "llm": cfg}, {"vision": "qwen2_5_vl", "llm": "qwen2_5_vl"})


def collective_calls(shape, strategy, w, stage=3, persistence_threshold=None):  # type: ignore[no-untyped-def]
    """Calls per kind the strategy's own hook states for workload ``w``."""
    opts: dict = {}
    if strategy == "zero":
        pytest.importorskip("disagg_zero")
        opts["stage"] = stage
        if persistence_threshold is not None:
            zero = {"stage3_param_persistence_threshold": persistence_threshold}
            opts["ds_config"] = {"zero_optimization": zero}
    cost = predict(
        shape, strategy, w.degree, w.replicas, w.seq_len, samples=w.samples, microbatches=w.microbatches,
        options=opts,
    )  # fmt: skip
    return cost.comm_calls_by_kind


class FusedDDP(Strategy):
    """A third party's data parallelism with (say) a fused kernel: ddp's bytes, half the FLOPs' time."""

    name: ClassVar[str] = "fused_ddp"
    distribution: ClassVar[str] = "disagg-fused"

    @classmethod
    def check(cls, family, degree, replicas, options):  # type: ignore[no-untyped-def]
        return [] if degree == 1 else ["degree must be 1"]

    @classmethod
    def estimate(cls, query: CostQuery, options: StrategyOptions) -> Cost | None:
        cost = DDPStrategy.estimate(query, options)
        assert cost is not None and cost.compute is not None
        # half the FLOPs, and half the work by shape the planner charges time by
        return replace(cost, flops=cost.flops / 2, compute=cost.compute.scaled(0.5))

    def parallelize(self, module):  # type: ignore[no-untyped-def]
        return module


class Silent(Strategy):
    """A third party's strategy that implements no cost hook."""

    name: ClassVar[str] = "silent"

    def parallelize(self, module):  # type: ignore[no-untyped-def]
        return module


def work(**kw) -> Workload:  # type: ignore[no-untyped-def]
    return Workload(
        **{
            "shapes": shapes_from_hf_config(SMALL),
            "vision_tokens": 1024,
            "text_tokens": 64,
            "samples": 4,
            **kw,
        }
    )


def test_third_party_hook_is_planned_and_a_silent_one_is_skipped():
    strategies = {"ddp": DDPStrategy, "fused_ddp": FusedDDP, "silent": Silent}
    # no launch cost: on this small model the GPU would be launch-bound, and faster
    # kernels would then (rightly) not help
    result = plan(work(), cluster_from("h100x8", {"gpus": 4, "layer_overhead": 0}), strategies)
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
    # the tensors' sum per device (CPU actors' rule); the allocator's terms on GPUs are
    # tests/test_published_fit.py's
    tensors_only = replace(cluster_from("h100x8", {"gpus": 4}), cuda_allocator=False, usable=1.0)
    roomy = plan(work(), tensors_only, strategies)
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
    tight = plan(work(), replace(tensors_only, device_memory=need - 1), strategies)
    assert not tight.ranked and tight.oom
    with pytest.raises(ValueError, match="no layout fits"):
        _ = tight.best


def test_recompute_keeps_less():
    shape = shapes_from_hf_config(SMALL)["llm"]
    q = CostQuery(shape, 2, 1, 4096)
    from disagg_llm_tp.cost import estimate

    saved = estimate(q, sequence_parallel=True)
    again = estimate(replace(q, recompute=True), sequence_parallel=True)
    assert again.activation_bytes < saved.activation_bytes and again.state_bytes == saved.state_bytes
    assert PRESETS["h100x8"].devices == 8


def test_cluster_description():
    assert parse_quantity("80GiB", "x") == 80 * 2**30 and parse_quantity("80GB", "x") == 80e9
    assert parse_quantity("360GB/s", "x") == 360e9 and parse_quantity("989T", "x") == 989e12
    c = cluster_from("h200x8", {"gpus": "4", "gpu_mem": "141GB", "intra_bw": "900GB/s", "mfu": "0.5"})
    assert (c.devices, c.device_memory, c.intra_bw, c.mfu) == (4, 141e9, 900e9, 0.5)
    assert c.bandwidth(4) == 900e9 and cluster_from("h100x8", {"nodes": 2}).bandwidth(16) == 50e9
    with pytest.raises(
        ValueError, match="unknown preset .a100.; allowed: h100x8, h200x8, cpu, cpu-local, FILE.json"
    ):
        cluster_from("a100")
    with pytest.raises(ValueError, match="--gpu-mem: 'lots' is not a quantity"):
        cluster_from("h100x8", {"gpu_mem": "lots"})


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


# -- the time model's fixed costs: α-β collectives, per-layer overhead, transfers, overlap ------------


def _layout(work_: Workload, cluster, strategies, **modules):  # type: ignore[no-untyped-def]
    """The fastest planned layout whose modules use these (strategy, degree, replicas, placement)."""
    res = plan(work_, cluster, strategies)
    found = [
        x
        for x in res.ranked + res.oom
        if all(
            (x.groups[m].strategy, x.groups[m].degree, x.groups[m].replicas) == v[:3] and x.placement == v[3]
            for m, v in modules.items()
        )
    ]
    assert found, modules
    return found[0]


def test_collective_calls_follow_the_strategies_collectives():
    from disagg.interfaces.cost import Workload as CommWork

    shapes = shapes_from_hf_config(SMALL)
    vision, llm = shapes["vision"], shapes["llm"]
    tensors = len(vision.tensors())
    one = CommWork(degree=2, replicas=1, seq_len=1024, samples=2, microbatches=1)
    two = replace(one, microbatches=2)
    # ulysses: 4 all-to-alls per full-attention block and microbatch; per step the agreement
    # all-reduce and one per 25 MiB gradient bucket (this small tower's fp32 gradients fill one)
    assert sum(t.numel for t in vision.tensors()) * 4 < 25 * 1024 * 1024
    assert collective_calls(vision, "ulysses", one) == {"all_to_all": 4, "all_reduce": 1 + 1}
    assert collective_calls(vision, "ulysses", two)["all_to_all"] == 8
    # TP: per-layer all-reduces for every image (an encoder's samples are encoded one by
    # one, so 2 samples in 1 microbatch call as often as 2 microbatches of 1), the
    # gradient reduction once per step
    tp1, tp2 = (collective_calls(vision, "megatron_tp", w) for w in (one, two))
    assert tp1["all_reduce"] == tp2["all_reduce"] == 2 * (5 * vision.depth + 2) + 2
    # the LLM: 7 per layer + the output layer's, the embedding's, the cross entropy's three per
    # loss chunk (2 x 1023 shifted rows: two chunks of 1024 tokens, each replayed in backward),
    # and the reduction's two
    assert collective_calls(llm, "megatron_tp", one)["all_reduce"] == 7 * llm.layers + 1 + 1 + 3 * 2 * 2 + 2
    # one rank talks to nobody
    assert collective_calls(vision, "ddp", replace(one, degree=1)) == {}

    # ZeRO-3 gathers per layer (disagg_zero.perlayer): DeepSpeed fetches each submodule's
    # partitioned tensors in one all-gather at each of its forwards and backwards (an encoder: one
    # pass per sample, here one per microbatch; the LLM: one forward, one loss chunk), the
    # persistent tensors once after the step; a reduce-scatter per backward
    def submodules(shape, small: int = -1) -> set[str]:
        return {t.name.rsplit(".", 1)[0] for t in shape.tensors() if t.numel > small}

    z3w = replace(one, degree=1, replicas=2, microbatches=2)
    z3 = collective_calls(vision, "zero", z3w, stage=3, persistence_threshold=0)
    assert z3["all_gather"] == 2 * 2 * len(submodules(vision)) and z3["reduce_scatter"] == 2
    llm_calls = collective_calls(llm, "zero", z3w, stage=3, persistence_threshold=0)
    assert llm_calls["all_gather"] == 2 * 2 * len(submodules(llm))
    small = sum(t.numel <= 100 for t in vision.tensors())
    assert 0 < small < tensors
    got = collective_calls(vision, "zero", z3w, stage=3, persistence_threshold=100)["all_gather"]
    # a submodule whose every tensor persists (the norms) is never gathered per call
    assert got == 2 * 2 * len(submodules(vision, small=100)) + small
    # DeepSpeed's default (1e5 elements) keeps this small tower whole: only the re-gather after the step
    assert collective_calls(vision, "zero", z3w, stage=3)["all_gather"] == tensors
    # the hook reports them beside the bytes
    cost = predict(vision, "ulysses", 2, 1, 1024, microbatches=2, samples=2)
    assert cost.comm_calls_by_kind["all_to_all"] == 8 and cost.to_dict()["comm_calls_by_kind"]


def test_alpha_beta_more_collectives_more_latency():
    from disagg.plan.model import collective_seconds, latency_steps

    c = cluster_from("cpu", {"gpus": 8, "intra_latency": "100us", "intra_bw": "1GB/s"})
    few = Cost(0, 0, {"all_reduce": 10**6}, 0, 0.0, comm_calls_by_kind={"all_reduce": 1})
    many = replace(few, comm_calls_by_kind={"all_reduce": 50})
    # same bytes, 49 more calls: 49 x 2(p-1) ring steps x α more
    assert collective_seconds(many, 2, c) - collective_seconds(few, 2, c) == pytest.approx(49 * 2 * 1e-4)
    assert collective_seconds(few, 2, c) == pytest.approx(2 * 1e-4 + 1e-3)
    # more ranks: more steps per call (ring), a tree broadcast grows with log2
    assert latency_steps("all_reduce", 8) == 14 and latency_steps("all_gather", 8) == 7
    assert latency_steps("broadcast", 8) == 3 and latency_steps("all_to_all", 1) == 0
    # with no latency the model is the bytes-only one
    flat = replace(c, intra_latency=0.0)
    assert collective_seconds(many, 2, flat) == pytest.approx(1e-3)


def test_small_steps_pay_per_microbatch_and_per_layer():
    """Layer passes and driver calls cost per microbatch: the same samples in more
    microbatches take longer; one replica per sample (ddp 1x2) beats one rank doing
    both (ddp 1x1, 2 microbatches) once layers cost more than the gradient all-reduce."""
    from disagg.plan.model import layers_of, overhead_seconds

    strategies = {"ddp": DDPStrategy}
    shapes = shapes_from_hf_config(SMALL)
    c = cluster_from(
        "cpu", {"gpus": 2, "layer_overhead": "2ms", "call_latency": "1ms", "intra_latency": "1us"}
    )
    assert overhead_seconds(shapes["vision"], 2, c) == pytest.approx(2 * 5 * 2e-3 + (2 * 2 + 2) * 1e-3)
    assert layers_of(shapes["llm"]) == 5
    w = work(samples=2)
    dp = _layout(w, c, strategies, vision=("ddp", 1, 2, "collocated"), llm=("ddp", 1, 2, "collocated"))
    one = _layout(w, c, strategies, vision=("ddp", 1, 1, "collocated"), llm=("ddp", 1, 1, "collocated"))
    assert (dp.microbatches, one.microbatches) == (1, 2)
    assert one.times["vision"]["overhead_s"] > dp.times["vision"]["overhead_s"]
    assert dp.step_time_s < one.step_time_s
    # and the same layouts with no fixed costs at all: the bytes-only model ranks by FLOPs and bytes
    free = replace(c, layer_overhead=0.0, call_latency=0.0, intra_latency=0.0)
    dp0 = _layout(w, free, strategies, vision=("ddp", 1, 2, "collocated"), llm=("ddp", 1, 2, "collocated"))
    assert all(t["overhead_s"] == 0 for t in dp0.times.values())


def test_async_launch_hides_under_compute():
    from disagg.plan.model import overhead_seconds

    shape = shapes_from_hf_config(SMALL)["vision"]
    gpu = replace(PRESETS["h100x8"], call_latency=0.0)
    launch = 3 * 5 * gpu.layer_overhead
    assert overhead_seconds(shape, 3, gpu, compute_s=10 * launch) == 0  # long kernels: launches hidden
    assert overhead_seconds(shape, 3, gpu, compute_s=launch / 4) == pytest.approx(launch * 3 / 4)
    cpu = replace(gpu, async_launch=False)
    assert overhead_seconds(shape, 3, cpu, compute_s=10 * launch) == pytest.approx(launch)


def test_encoders_ahead_overlaps_fixed_costs_and_transfers_pay_a_hop():
    strategies = {"ddp": DDPStrategy}
    c = cluster_from("cpu", {"gpus": 2, "call_latency": "5ms", "layer_overhead": "1ms"})
    w = work(samples=4)
    coll = _layout(w, c, strategies, vision=("ddp", 1, 1, "collocated"), llm=("ddp", 1, 1, "collocated"))
    dis = _layout(w, c, strategies, vision=("ddp", 1, 1, "disaggregated"), llm=("ddp", 1, 1, "disaggregated"))
    assert dis.schedule == "encoders_ahead" and coll.schedule == "sequential" and dis.microbatches == 4
    per = [sum(t.values()) for t in dis.times.values()]
    assert dis.step_time_s == pytest.approx(max(per) + min(per) / 4)  # every term overlaps, fixed ones too
    assert coll.step_time_s == pytest.approx(sum(sum(t.values()) for t in coll.times.values()))
    assert dis.step_time_s < coll.step_time_s
    # one object-store hop per microbatch, on top of the bytes
    hop = dis.times["vision"]["transfer_s"] - dis.costs["vision"].sent_bytes / c.bandwidth(2)
    assert hop == pytest.approx(4 * 5e-3)


def test_cluster_latencies_from_flags_files_and_presets(tmp_path):
    from disagg.plan.cluster import load_cluster, parse_seconds, save_cluster

    assert parse_seconds("2us", "x") == pytest.approx(2e-6) and parse_seconds("0.5ms", "x") == 5e-4
    with pytest.raises(ValueError, match="--call-latency: 'soon' is not a duration"):
        cluster_from("cpu", {"call_latency": "soon"})
    for name in ("h100x8", "h200x8", "cpu"):
        p = PRESETS[name]
        assert 0 < p.intra_latency <= p.inter_latency and p.layer_overhead > 0 and p.call_latency > 0
    assert PRESETS["h100x8"].async_launch and not PRESETS["cpu"].async_launch
    c = cluster_from("h100x8", {"nodes": 2, "intra_latency": "2us"})
    assert c.latency(8) == 2e-6 and c.latency(16) == PRESETS["h100x8"].inter_latency
    path = save_cluster(c, tmp_path / "c.json")
    assert load_cluster(path) == c and cluster_from(str(path)) == c
    (tmp_path / "bad.json").write_text('{"name": "x", "warp": 9}')
    with pytest.raises(ValueError, match=r"unknown keys \['warp'\]"):
        cluster_from(str(tmp_path / "bad.json"))


def test_calibration_measures_positive_finite_figures():
    """The microbenchmarks behind ``--calibrate`` / ``cpu-local`` (gloo between two
    local processes included; no Ray). Their values depend on the machine and its
    load: only their sanity is asserted."""
    import math

    from disagg.plan.calibrate import calibrate

    c = calibrate(PRESETS["cpu"], ray_calls=False)
    for v in (c.peak_flops, c.intra_bw, c.intra_latency, c.layer_overhead, c.call_latency):
        assert math.isfinite(v) and v > 0
    assert c.mfu == 1.0 and c.source.startswith("measured (matmul, layer, gloo, gemm curve, memory)")
    assert c.gemm_ridge >= 0 and c.mem_bw > 0 and (c.gemm_tile, c.compute_units) == (0, 0)
    assert c.call_latency == PRESETS["cpu"].call_latency  # not measured without Ray


def test_comm_counter_counts_calls_beside_bytes():
    from disagg.interfaces.comm import CommCounter

    c = CommCounter()
    c.add("all_reduce", 100)
    c.add("all_reduce", 12, calls=3)  # one add for three small collectives
    c.add("zero3_analytic", 5000, calls=0)  # bytes a library moves in calls it does not show
    assert c.calls() == {"all_reduce": 4}
    assert c.reset() == {"all_reduce": 112, "zero3_analytic": 5000}
    assert c.calls() == {} and c.total() == 0
