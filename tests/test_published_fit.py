"""The memory and cost terms behind the published setting's tables (``python -m
disagg.bench.published``), each against a hand computation on a stated shape: the allocator's
view (:mod:`disagg.kit.cost.memory`: CUDA contexts, NCCL buffers, the transient, fragmentation),
optimizer offload's device/host split and seconds (:mod:`disagg.kit.cost.offload`), context
parallelism's K/V exchange, attention and state (:mod:`disagg.kit.cost.context_parallel`,
:mod:`disagg.plan.extended`), and the fit search's edge.

The goals (DHP at 128k with fp32 masters, 1M under ``bf16-pure``, ZeRO-3 where the paper saw it) are
the model's output, printed met / not met by the bench (``fit_goal_lines``); one is asserted
(:func:`test_dhp_fits_a_million_vision_tokens_in_bf16_pure_with_tiled_mlps`, issue 38's last
must-show) after its terms are checked by hand. Pure computation."""

from __future__ import annotations

import pytest

from disagg.interfaces.compute import AttentionCore, Compute
from disagg.interfaces.shapes import DecoderShape
from disagg.kit.cost import memory as mem
from disagg.kit.cost import offload as off
from disagg.kit.cost.context_parallel import attention, kv_exchange, kv_gathered_bytes

MiB, GB = 2**20, 10**9


def _group(module, state, saved, transient, gathered=0, communicators=1, alltoall=0):
    return mem.GroupMemory(module, state, gathered, saved, transient, communicators, alltoall)


# -- the allocator's view ------------------------------------------------------------------------
def test_cuda_context_is_counted_once_per_process_on_the_device():
    one = mem.device_memory([_group("llm", 10 * GB, 5 * GB, 1 * GB)])
    two = mem.device_memory(
        [_group("vision", 1 * GB, 2 * GB, 1 * GB), _group("llm", 10 * GB, 5 * GB, 1 * GB)]
    )
    # 600 MiB of context + 32 MiB of cuBLAS workspace per process; collocated groups: two processes
    assert one.terms["cuda_context"] == (600 + 32) * MiB
    assert two.terms["cuda_context"] == 2 * (600 + 32) * MiB
    assert mem.device_memory([_group("llm", 0, 0, 0)], processes=3).terms["cuda_context"] == 3 * 632 * MiB


def test_nccl_buffers_per_communicator_and_all_to_all():
    # a ring: 32 channels x 2 connections x 12 MiB (NVIDIA/nccl#1685, #986)
    assert mem.nccl_bytes(1) == 32 * 2 * 12 * MiB == 805_306_368
    assert mem.nccl_bytes(3) == 3 * 805_306_368
    # all-to-all over 8 GPUs (7 peers): the measured 4.34 - 1.06 GB on top; 3 peers: 3/7 of it
    assert mem.nccl_bytes(1, 7) == 805_306_368 + 3_280_000_000
    assert mem.nccl_bytes(1, 3) == 805_306_368 + 3_280_000_000 * 3 // 7
    # a TP 8 group: one communicator; TP 4 x CP 2: TP, CP and the group's; FSDP over 8: one
    assert mem.communicators(8, 1, 1) == 1
    assert mem.communicators(4, 2, 1) == 3
    assert mem.communicators(1, 8, 1) == 1
    assert mem.communicators(2, 2, 2) == 4


def test_transient_is_the_largest_group_s_and_fragmentation_five_percent_of_what_is_served():
    v = _group("vision", 2 * GB, 3 * GB, 4 * GB, communicators=1, alltoall=7)
    llm = _group("llm", 20 * GB, 6 * GB, 1 * GB, gathered=1 * GB, communicators=1)
    d = mem.device_memory([v, llm])
    # the groups run one after the other: one block in backward at a time, the larger transient
    assert d.terms["transient"] == 4 * GB
    served = (2 + 3) * GB + (20 + 1 + 6) * GB + 4 * GB
    assert d.terms["fragmentation"] == int(0.05 * served)
    assert d.terms["nccl_buffers"] == 2 * 805_306_368 + 3_280_000_000
    assert d.total == served + int(0.05 * served) + 2 * 632 * MiB + 2 * 805_306_368 + 3_280_000_000
    assert d.largest(1) == [("llm state", 20 * GB)]


def test_the_planner_counts_the_allocator_on_gpus_and_only_tensors_on_cpu():
    from dataclasses import replace

    from disagg.interfaces import Cost
    from disagg.plan.cluster import PRESETS
    from disagg.plan.extended import GroupCost
    from disagg.plan.model import Group, Layout, evaluate

    cost = Cost(state_bytes=10 * GB, activation_bytes=2 * GB, comm_bytes_by_kind={}, sent_bytes=0, flops=0)
    gm = _group("llm", 10 * GB, 2 * GB, 1 * GB)
    x = Layout({"llm": Group("llm", "megatron_tp", 8, 1)}, "collocated", 1, "sequential")
    gpu = PRESETS["h100x8"]
    evaluate(x, {"llm": cost}, gpu, None, {"llm": GroupCost(cost, gm)})
    assert x.memory_bytes == mem.device_memory([gm]).total > 12 * GB
    assert x.memory_terms["cuda_context"] == 632 * MiB
    y = Layout({"llm": Group("llm", "megatron_tp", 8, 1)}, "collocated", 1, "sequential")
    evaluate(y, {"llm": cost}, replace(gpu, cuda_allocator=False), None, {"llm": GroupCost(cost, gm)})
    assert y.memory_bytes == 12 * GB and not y.memory_terms


# -- optimizer offload ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("precision", "device", "host", "whole"),
    [
        # device: weight + in-flight gradient in the compute dtype; host: stepped copy + accumulator + moments
        ("bf16", 2 + 2, 4 + 4 + 8, 18),
        ("fp32", 4 + 4, 4 + 4 + 8, 16),
        ("bf16-pure", 2 + 2, 2 + 2 + 4, 8),
    ],
)
def test_offload_moves_masters_accumulators_and_moments_to_the_host(precision, device, host, whole):
    n, tensors = 1000, 3
    kept = off.state_split(n, precision, False, tensors=tensors)
    moved = off.state_split(n, precision, True, tensors=tensors)
    assert kept == off.StateSplit(whole * n + 4 * tensors, 0)
    assert moved == off.StateSplit(device * n, host * n + 4 * tensors)


def test_offload_split_under_zero_sharding():
    # ZeRO-1 over 8 ranks of 800 elements under bf16: weights 2 + gradients 4 whole, masters +
    # moments (12) on 100; with offload the 16 host bytes on 100, the 2 + 2 device bytes on 800
    assert off.state_split(800, "bf16", False, 1, 1, 8) == off.StateSplit(6 * 800 + 12 * 100, 0)
    assert off.state_split(800, "bf16", True, 1, 1, 8) == off.StateSplit(4 * 800, 16 * 100)
    # ZeRO-3 / FSDP: everything over 8
    assert off.state_split(800, "bf16", False, 8, 8, 8) == off.StateSplit(18 * 100, 0)


def test_offload_seconds_by_hand():
    n = 10**9
    t = off.offload_seconds(n, "bf16", microbatches=1, compute_s=0.0, ranks_per_node=1)
    pcie, host = 0.8 * 64e9, 0.7 * 16 * 38.4e9
    per_mb = 2 * n / pcie + n * (2 + 2 * 4) / host  # bf16 gradient out, read it + read/write the fp32 sum
    adam = n * (2 * 4 + 4 * 4 + 4 + 2) / host  # master r/w, moments r/w, accumulator, bf16 weight out
    back = 2 * n / pcie
    assert t["exposed_s"] == pytest.approx(per_mb + adam + back)
    # with 4 microbatches of 1 s compute each, three of the four transfers hide under the next one
    t4 = off.offload_seconds(n, "bf16", microbatches=4, compute_s=4.0, ranks_per_node=1)
    assert t4["exposed_s"] == pytest.approx(4 * per_mb - 3 * min(per_mb, 1.0) + adam + back)


def test_offloaded_tp8_llm_state_by_the_parameter_count(strategies):
    """The published LLM at TP 8: without offload the rule equals megatron_tp's own estimate (an
    independent count); with it 4 B per element stays on the device and 16 B goes to the host."""
    from disagg.bench.published import QWEN2_5_VL_32B, predict_groups
    from disagg.plan.published import published_shapes

    llm = published_shapes(QWEN2_5_VL_32B)["llm"]
    local = sum(t.local_numel(8) for t in llm.tensors())
    layout = {
        "vision": {"strategy": "ulysses", "degree": 8, "shard": "parameters"},
        "llm": {"strategy": "megatron_tp", "degree": 8, "sequence_parallel": True},
    }
    plain = predict_groups(layout, 16 * 1024, "full", "bf16", strategies)["llm"]
    assert plain.cost.state_bytes == off.state_split(local, "bf16", False, tensors=len(llm.tensors())).device
    moved = predict_groups(
        {**layout, "llm": {**layout["llm"], "offload": "optimizer"}}, 16 * 1024, "full", "bf16", strategies
    )
    assert moved["llm"].cost.state_bytes == 4 * local
    assert moved["llm"].memory.host == 16 * local + 4 * len(llm.tensors())
    assert moved["llm"].offload is not None and moved["llm"].offload["microbatches"] == 8


@pytest.mark.parametrize("tower", ["ulysses", "megatron_tp"])
def test_activation_offload_moves_every_blocks_input_but_one(strategies, tower):
    """``offload: all`` against ``optimizer`` at 16k, each group by an independent count: the LLM
    under TP 8 with SP keeps each of its 64 layers' input for ``T/8`` tokens per rank (bf16); all of
    them go to the host, all but one leave the device (one is back for the replay); the state is
    the optimizer offload's either way; the copies' seconds are twice the host bytes per microbatch
    over the assumed link."""
    from disagg.bench.published import QWEN2_5_VL_32B, TEXT_TOKENS, predict_groups
    from disagg.kit.cost import activation_offload as act_off
    from disagg.plan.published import published_shapes

    shapes = published_shapes(QWEN2_5_VL_32B)
    llm, vision = shapes["llm"], shapes["vision"]
    n = 16 * 1024
    sp = {"degree": 8, "sequence_parallel": True} if tower == "megatron_tp" else {"degree": 8}
    layout = {
        "vision": {"strategy": tower, **sp, "offload": "optimizer"},
        "llm": {"strategy": "megatron_tp", "degree": 8, "sequence_parallel": True, "offload": "optimizer"},
    }
    base = predict_groups(layout, n, "full", "bf16-pure", strategies)
    both = {m: {**g, "offload": "all"} for m, g in layout.items()}
    off = predict_groups(both, n, "full", "bf16-pure", strategies)
    held = -(-(n // vision.unit + TEXT_TOKENS) // 8)
    host = act_off.offloaded_input_bytes(llm, held, 2)
    assert host == llm.layers * held * llm.hidden * 2
    g, b = off["llm"], base["llm"]
    assert g.memory.host - b.memory.host == host
    assert b.cost.activation_bytes - g.cost.activation_bytes == host - host // llm.layers
    assert g.cost.state_bytes == b.cost.state_bytes and g.memory.transient == b.memory.transient
    assert g.activation_offload == {"host_bytes": host, "microbatches": 8}
    seconds = act_off.offload_seconds(host, 8)["exposed_s"]
    assert seconds == pytest.approx(2 * host * 8 / act_off.ACTIVATION_LINK_BYTES_PER_S)
    # the tower too: its blocks' inputs for its tokens per rank (ulysses and TP + SP: n / 8)
    v_host = act_off.offloaded_input_bytes(vision, n // 8, 2)
    assert off["vision"].memory.host - base["vision"].memory.host == v_host


def test_activation_offload_is_refused_without_full_recompute(strategies):
    from disagg.bench.published import predict_groups

    layout = {
        "vision": {"strategy": "ulysses", "degree": 8},
        "llm": {"strategy": "megatron_tp", "degree": 8, "offload": "activations"},
    }
    with pytest.raises(ValueError, match="recompute: full"):
        predict_groups(layout, 16 * 1024, "none", "bf16", strategies)


# -- context parallelism -------------------------------------------------------------------------
SMALL = DecoderShape(hidden=64, heads=4, kv_heads=2, layers=3, intermediate=128, vocab=100)


def test_kv_exchange_by_hand():
    # T = 16 tokens, CP 4, TP 1, bf16, 2 samples, full recompute: per layer and sample the whole
    # K and V are 2 x 16 x 2 heads x 16 dims x 2 bytes = 2048 bytes; a rank sends 3/4 of them
    kinds, calls = kv_exchange(SMALL, 16, 4, 1, 2, 2, "full")
    assert kinds == {"all_gather": 2 * 3 * 2 * 1536, "reduce_scatter": 3 * 2 * 1536}
    assert calls == {"all_gather": 2 * 3 * 2, "reduce_scatter": 3 * 2}
    # without recompute one gather per layer; TP 2 halves the KV heads a rank exchanges
    kinds, _ = kv_exchange(SMALL, 16, 4, 2, 2, 1, "none")
    assert kinds == {"all_gather": 3 * 768, "reduce_scatter": 3 * 768}
    assert kv_exchange(SMALL, 16, 1, 1, 2, 2, "full") == ({}, {})
    # the gathered K/V held: one layer under full recompute, all three without
    assert kv_gathered_bytes(SMALL, 16, 4, 1, 2, "full") == 2048
    assert kv_gathered_bytes(SMALL, 16, 4, 1, 2, "none") == 3 * 2048


def test_cp_attention_sees_the_whole_sequence():
    core = AttentionCore(4, 4, 8, 2, causal=True, count=3)
    assert core.flops == 4 * 4 * 4 * 8 * 2 * 3 / 2
    widened = attention(Compute(attention=(core,)), 4)
    # each rank's 4 queries against all 16 keys, causal and load-balanced: 4x the T/N sequence's work
    assert widened.attention[0].keys == 16 and widened.flops == 4 * core.flops
    window = AttentionCore(4, 4, 8, 2, causal=False)
    assert attention(Compute(attention=(window,)), 4).attention[0].keys == 4  # only causal cores widen


def test_tp_cp_and_fsdp_cp_state_by_the_parameter_count(strategies):
    """TP 4 x CP 2: weights (2 B) and gradients (4 B) of the TP slice on every CP rank, masters and
    moments (12 B) over the 2 CP ranks; FSDP + CP 8: all 18 B over 8."""
    from disagg.bench.published import QWEN2_5_VL_32B, predict_groups
    from disagg.plan.published import published_shapes

    llm = published_shapes(QWEN2_5_VL_32B)["llm"]
    tensors = len(llm.tensors())
    tp4 = sum(t.local_numel(4) for t in llm.tensors())
    whole = sum(t.numel for t in llm.tensors())
    vision = {"strategy": "ulysses", "degree": 8, "shard": "parameters"}
    got = predict_groups(
        {"vision": vision, "llm": {"strategy": "megatron_tp", "degree": 4, "context_parallel": 2}},
        16 * 1024,
        "full",
        "bf16",
        strategies,
    )["llm"]
    assert got.cost.state_bytes == 6 * tp4 + 12 * -(-tp4 // 2) + 4 * tensors
    assert got.memory.communicators == 3
    fsdp = predict_groups(
        {"vision": vision, "llm": {"strategy": "ddp", "shard": "parameters", "context_parallel": 8}},
        16 * 1024,
        "full",
        "bf16",
        strategies,
    )["llm"]
    assert fsdp.cost.state_bytes == 18 * -(-whole // 8) + 4 * tensors
    assert fsdp.cost.comm_bytes_by_kind["all_gather"] > 0 and "all_reduce" not in fsdp.cost.comm_bytes_by_kind


# -- the fit search and its tables ---------------------------------------------------------------
@pytest.fixture(scope="module")
def strategies():
    pytest.importorskip("disagg_vision_sp")
    pytest.importorskip("disagg_llm_tp")
    pytest.importorskip("disagg_zero")
    from disagg.plugins import get_registry

    return get_registry().strategies


def test_longest_fit_is_the_edge_and_its_reason_is_the_next_step_s_largest_term(strategies):
    from disagg.bench.published_fit import FIT_LAYOUTS, STEP, device, longest_fit

    budget = int(0.9 * 80 * GB)
    fit = longest_fit("dhp_sp", "bf16+offload", budget, strategies)
    assert fit.longest and fit.memory_bytes <= budget
    view, _ = device(FIT_LAYOUTS["dhp_sp"], fit.longest, "bf16+offload", strategies)
    assert view.total == fit.memory_bytes <= budget
    over, _ = device(FIT_LAYOUTS["dhp_sp"], fit.longest + STEP, "bf16+offload", strategies)
    assert over.total > budget
    name, value = over.largest(1)[0]
    assert fit.stopped_by == name and f"{name} {value / 1e9:.1f} GB" in fit.reason
    # every term the device counts is named in the row's JSON
    assert set(fit.to_dict(0.9)["memory_terms"]) >= {
        "cuda_context",
        "nccl_buffers",
        "transient",
        "fragmentation",
    }


def test_a_row_validation_would_refuse_is_not_predicted(strategies):
    """The fit table asks each strategy's own precision checks, as validation does: ``zero`` with
    DeepSpeed's offloaded optimizer under ``bf16-pure`` is refused (DeepSpeed offloads bf16
    masters only with its own ``DeepSpeedCPUAdam``), so its rows carry no length; under ``bf16``
    (verified at stages 1 and 3) the same layout is predicted."""
    from disagg.bench.published_fit import longest_fit

    budget = int(0.9 * 80 * GB)
    for recipe in ("bf16-pure+offload", "bf16-pure+all"):
        row = longest_fit("zero3", recipe, budget, strategies)
        assert row.longest is None and "DeepSpeedCPUAdam" in row.reason, row
    assert longest_fit("zero3", "bf16+offload", budget, strategies).longest


def test_zero3_terms_in_deepspeed_s_bf16_mode(strategies):
    """What the ZeRO-3 row is made of at 16k under ``bf16`` (the paper's "BF16 mixed precision"):
    the LLM state is 18 B per parameter over 8 ranks (bf16 partition 2, fp32 master 4, gradient 4,
    moments 8), and the gathered term is DeepSpeed's default gather window: the largest layer
    (replayed under full recompute) + ``stage3_max_reuse_distance`` (1e9) +
    ``stage3_max_live_parameters`` (1e9) + one tensor past the prefetch bucket, in bf16."""
    from disagg.bench.published import QWEN2_5_VL_32B
    from disagg.bench.published_fit import FIT_LAYOUTS, device
    from disagg.plan.published import published_shapes

    llm = published_shapes(QWEN2_5_VL_32B)["llm"]
    params = sum(t.numel for t in llm.tensors())
    view, costs = device(FIT_LAYOUTS["zero3"], 16 * 1024, "bf16", strategies)
    assert costs["llm"].state_bytes == pytest.approx(18 * params / 8, rel=1e-3)
    layer = sum(t.numel for t in llm.tensors() if t.name.startswith("layers.0."))
    largest = max(t.numel for t in llm.tensors())
    assert costs["llm"].gathered_bytes == 2 * (max(layer, largest) + 10**9 + 10**9 + largest)
    assert view.terms["llm state"] == costs["llm"].state_bytes


def test_the_table_prints_every_layout_and_recipe():
    from disagg.bench.published import PAPER
    from disagg.bench.published_fit import FIT_LAYOUTS, FIT_RECIPES, Fit, fit_md

    fits = [Fit(n, p, 2048, 1, "r") for n in FIT_LAYOUTS for p in FIT_RECIPES]
    md = fit_md(fits, 72 * GB, PAPER, usable=0.9)
    assert "usable 0.90 of 80 GB" in md
    for name in FIT_LAYOUTS:
        assert f"| {name} | " + " | ".join(["2k (0.0 GB)"] * len(FIT_RECIPES)) + " |" in md


def test_the_goals_are_printed_met_or_not():
    """The goals are stated in the bench's output for the record, whichever way they fall."""
    from disagg.bench.published_fit import Fit, fit_goal_lines

    lines = fit_goal_lines(
        [
            Fit("dhp_sp", "bf16+offload", 200 * 1024),
            Fit("dhp_tp4_cp2", "bf16+offload", 100 * 1024),
            Fit("tp_sp", "bf16-pure", 2000 * 1024),  # not DHP: no goal of its own
            Fit("dhp_sp", "bf16-pure", 900 * 1024, stopped_by="llm state"),
        ],
        0.9,
    )
    assert lines == [
        "goal: DHP fits 131,072 vision tokens under `bf16+offload` (usable 0.90): met "
        "(predicted 200k (dhp_sp))",
        "goal: DHP fits 1,000,000 vision tokens under `bf16-pure` (usable 0.90): not met "
        "(predicted 900k (dhp_sp); stopped by llm state)",
    ]


def test_terms_list_the_buffers():
    """A layout's memory terms (what a "does not fit" reason names) include each module's
    ``Cost.buffer_bytes`` (ZeRO-3's reduce bucket, ``ddp``'s gradient bucket), largest first."""
    from disagg.bench.published_fit import terms
    from disagg.interfaces.cost import Cost

    def cost(state: int, act: int, buffers: int) -> Cost:
        return Cost(
            state_bytes=state,
            activation_bytes=act,
            comm_bytes_by_kind={},
            sent_bytes=0,
            flops=0.0,
            buffer_bytes=buffers,
        )

    got = terms({"vision": cost(5, 1, 0), "llm": cost(3, 2, 7)})
    assert got == [
        ("llm buffers", 7),
        ("vision state", 5),
        ("llm state", 3),
        ("llm activations", 2),
        ("vision activations", 1),
    ]


# -- sequence-tiled MLPs (parallel.<module>.mlp_tiles) -------------------------------------------
def test_tiles_take_the_mlp_out_of_the_llm_s_block_by_hand(strategies):
    """The published LLM at TP 8 + SP, 1M vision tokens (``T`` = 262,656 LLM tokens, ``c = T/8``
    per rank), bf16: ``mlp_tiles: auto`` keeps per layer the MLP's input shard (``H`` on ``c``)
    instead of the gate/up input shards (``2H`` on ``c``) and SwiGLU's ``4·I/8`` on ``T``; one
    tile's replay is a peak: ``8 x ceil(c / ceil(T / H))`` gathered rows of ``2H + 4·I/8``. Both
    the activations (one block under full recompute with offload all) and the backward transient
    (one block's saves) fall by exactly that, computed here from the shape alone."""
    from disagg.bench.published import QWEN2_5_VL_32B, TEXT_TOKENS
    from disagg.bench.published_fit import FIT_LAYOUTS, device_groups
    from disagg.plan.published import published_shapes

    llm = published_shapes(QWEN2_5_VL_32B)["llm"]
    h, i = llm.hidden, llm.intermediate
    n = 1024 * 1024
    t = n // 4 + TEXT_TOKENS
    c = -(-t // 8)
    tiles = -(-8 * c // h)  # auto: a gathered tile of about H rows
    rows = 8 * -(-c // tiles)
    saved = 2 * (2 * h * c + 4 * (i // 8) * t - h * c)  # per layer, bf16
    peak = 2 * rows * (2 * h + 4 * (i // 8))
    # the loss chunk's replay (1024 rows: their bf16 input, fp32 logits of V/8, masks) is a peak
    # too, never at once with a tile's: the larger one counts
    loss = 2 * 1024 * h + 4 * 1024 * (llm.vocab // 8) + 10 * 1024
    assert peak > loss
    base, _ = device_groups(FIT_LAYOUTS["dhp_sp"], n, "bf16-pure+all", strategies)
    tiled, groups = device_groups(FIT_LAYOUTS["dhp_sp"], n, "bf16-pure+all+tiles", strategies)
    assert base.terms["llm activations"] - tiled.terms["llm activations"] == saved - peak + loss
    assert base.terms["transient"] - tiled.terms["transient"] == saved - peak + loss
    assert base.terms["llm state"] == tiled.terms["llm state"]
    # the replay's MLP forward: 2 x 3 x H x I FLOPs per token and layer, per sample
    assert (
        groups["llm"].cost.flops
        > device_groups(FIT_LAYOUTS["dhp_sp"], n, "bf16-pure+all", strategies)[1]["llm"].cost.flops
    )


def test_dhp_fits_a_million_vision_tokens_in_bf16_pure_with_tiled_mlps(strategies):
    """Issue 38's last must-show: DHP (``ulysses`` 8 tower + ``megatron_tp`` 8 + SP LLM, recompute
    full, ``offload: all``, every MLP in ``auto`` tiles) fits 1,000,000 vision tokens per image in
    ``bf16-pure`` at 90% of 80 GB; ZeRO-3 is not predicted with tiles (``zero`` refuses them) and
    the same DHP without tiles stays below 1M (the tiles are what get it there)."""
    from disagg.bench.published_fit import longest_fit

    budget = int(0.9 * 80 * GB)
    fit = longest_fit("dhp_sp", "bf16-pure+all+tiles", budget, strategies)
    assert fit.longest is not None and fit.longest >= 1_000_000, fit.reason
    assert fit.to_dict(0.9)["mlp_tiles"] == "auto" and fit.to_dict(0.9)["offload"] == "all"
    assert longest_fit("dhp_sp", "bf16-pure+all", budget, strategies).longest < 1_000_000
    zero = longest_fit("zero3", "bf16+all+tiles", budget, strategies)
    assert zero.longest is None and "sequence-tiled" in zero.reason
