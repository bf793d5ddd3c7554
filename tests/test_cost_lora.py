"""The cost model and the planner know LoRA (``train.modules.<m>.lora``, issue 27 item 5):
the base frozen (its weights only: no gradient, no optimizer state, no gradient reduction, no
weight-gradient products), the adapters trained in full. Analytic, no ranks: what
``examples/bench/lora_bytes.py`` measures equal to these terms is ``test_lora_bytes``."""

from __future__ import annotations

import pytest

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

from published_space import paper_space, tensors_only  # noqa: E402

LLM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora(targets=LLM_TARGETS, r=16, saved=()):
    from disagg.interfaces.lora import LoraSpec

    return LoraSpec(r=r, alpha=2 * r, dropout=0.0, targets=targets, save_patterns=saved)


@pytest.fixture(scope="module")
def shapes():
    from disagg.bench.published import QWEN2_5_VL_32B
    from disagg.plan.published import published_shapes

    return published_shapes(QWEN2_5_VL_32B)


def test_lora_state_reduction_and_flops_on_the_32b_llm(shapes):
    """megatron_tp 8 x 2 on the 32B LLM under ``bf16``: state = 18 B per adapter element this rank
    holds (lora_A whole / lora_B split behind a column base, the reverse behind a row base) + 4 B
    per AdamW step + 2 B per frozen base element (its bf16 weight, no master); the replicas
    all-reduce only the adapters' gradients; the weight-gradient products of the base are gone."""
    from disagg.cost import predict
    from disagg.interfaces import CostQuery
    from disagg.kit.cost.training import query_trained

    llm, spec = shapes["llm"], _lora()
    kw = dict(samples=8, exchanged_rows=1024, exchanged_width=5120)
    full = predict(llm, "megatron_tp", 8, 2, 1536, "bf16", **kw)
    lora = predict(llm, "megatron_tp", 8, 2, 1536, "bf16", lora=spec, **kw)
    tr = query_trained(CostQuery(shape=llm, degree=8, replicas=2, seq_len=1536, lora=spec))
    assert len(tr.adapters) == 2 * 7 * llm.layers and len(tr.frozen) == len(llm.tensors())
    h, r = llm.hidden, spec.r
    q = llm.layers * ((r * h) + (h * r) // 8)  # q_proj: column base -> lora_A [r, h] whole, lora_B split
    o = llm.layers * ((r * h) // 8 + h * r)  # o_proj: row base -> lora_A split, lora_B [h, r] whole
    assert q == sum(t.local_numel(8) for t in tr.adapters if ".q_proj." in t.name)
    assert o == sum(t.local_numel(8) for t in tr.adapters if ".o_proj." in t.name)
    adapters = sum(t.local_numel(8) for t in tr.adapters)
    base = sum(t.local_numel(8) for t in llm.tensors())
    assert lora.state_bytes == 18 * adapters + 4 * len(tr.adapters) + 2 * base
    assert lora.state_bytes < 0.3 * full.state_bytes
    # the data-parallel reduction: one flat all-reduce of the local trained gradients
    from disagg.kit.cost.rules import all_reduce

    dp_full = all_reduce(4 * base, 2)
    dp_lora = all_reduce(4 * adapters, 2)
    assert full.comm_bytes_by_kind["all_reduce"] - lora.comm_bytes_by_kind["all_reduce"] > 0.99 * (
        dp_full - dp_lora
    )
    # no weight-gradient GEMM for the frozen base (~1/3 of its dense work), the adapters' few
    assert 0.6 * full.flops < lora.flops < 0.8 * full.flops
    # the shapes the planner times by lose the same work
    assert lora.compute is not None and full.compute is not None
    assert abs(lora.compute.flops / full.compute.flops - lora.flops / full.flops) < 0.01


def test_lora_on_the_tower_keeps_the_saved_parts_training(shapes):
    """ulysses under ``bf16`` and ``bf16-pure``: the merger in ``modules_to_save`` trains in full,
    qkv/proj get adapters, the rest of the tower is frozen; its gradient all-reduce carries only
    what trains."""
    from disagg.cost import predict
    from disagg.interfaces import CostQuery
    from disagg.kit.cost.rules import grad_all_reduce
    from disagg.kit.cost.training import query_trained

    vision = shapes["vision"]
    spec = _lora(("attn.qkv", "attn.proj"), 8, ("merger.*",))
    cost = predict(vision, "ulysses", 4, 2, 4096, "bf16", lora=spec)
    tr = query_trained(CostQuery(shape=vision, degree=4, replicas=2, seq_len=4096, lora=spec))
    merger = [t for t in vision.tensors() if t.name.startswith("merger.")]
    assert set(merger) <= set(tr.trainable) and not set(merger) & set(tr.frozen)
    assert len(tr.adapters) == 2 * 2 * vision.depth
    assert cost.comm_bytes_by_kind["all_reduce"] == grad_all_reduce([t.numel for t in tr.trainable], 8)
    warm = sum(t.numel for t in tr.trainable)
    cold = sum(t.numel for t in tr.frozen)
    assert cost.state_bytes == 18 * warm + 4 * len(tr.trainable) + 2 * cold
    pure = predict(vision, "ulysses", 4, 2, 4096, "bf16-pure", lora=spec)
    assert pure.state_bytes == 8 * warm + 4 * len(tr.trainable) + 2 * cold
    # bf16-pure reduces bf16 gradients
    assert pure.comm_bytes_by_kind["all_reduce"] == grad_all_reduce([t.numel for t in tr.trainable], 8, 2)


def test_plan_with_lora_prefers_a_smaller_tp_degree():
    """The published 32B at 16k vision tokens on 8 x 80 GB under ``bf16``: trained in full the
    LLM's state (18 B per parameter) only fits split 8 ways; with LoRA on its seven linears the
    frozen bf16 base (2 B per parameter) fits on fewer ranks per sample and the plan takes such a
    layout (today 8 replicas of the whole LLM), faster: no layout at that degree fits in full."""
    from disagg.plan.published import plan_published
    from disagg.plugins import get_registry

    reg = get_registry()
    # the tensor-only memory model at all 80 GB, without the modelled CP / offload layouts: the
    # conditions this comparison was stated under (tests/test_plan_published.py)
    gpus = tensors_only()
    planned = plan_published(16 * 1024, reg, gpus, modelled_keys=False)
    # the comparison is among the layouts that split the LLM by degree (TP, ZeRO-3: the paper's
    # space); the LLM under ddp + FSDP2, sharded 8 ways at degree 1, is compared on its own below
    by_degree = paper_space(planned)
    full = by_degree[0]
    lora = plan_published(16 * 1024, reg, gpus, lora={"llm": _lora()}, modelled_keys=False).best
    assert full.groups["llm"].strategy == "megatron_tp" and full.groups["llm"].degree == 8
    assert lora.groups["llm"].degree < full.groups["llm"].degree
    assert not [x for x in by_degree if x.groups["llm"].degree == lora.groups["llm"].degree]
    assert lora.step_time_s < full.step_time_s
    assert lora.step_time_s < planned.best.step_time_s  # ... and than the sharded full LLM
