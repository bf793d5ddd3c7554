"""The analytic cost model against real modules: parameter tensors, state bytes
and saved-activation bytes of a tiny Qwen2.5-VL vision tower built from the same
config values (single process; the group-level byte counts are checked against
real runs in tests/test_bench.py). The tower is described by its family
(``qwen2_5_vl``, disagg-vision-sp) and costed by each strategy's own hook."""

from __future__ import annotations

import pytest
import torch

from disagg.bench.published import LAYOUTS_32B, QWEN2_5_VL_32B, predict_published, ratios
from disagg.cost import EncoderShape, predict, shapes_for
from disagg.kit.recompute.activations import saved_bytes_hooks

for _plugin in ("disagg_vision_sp", "disagg_llm_tp", "disagg_zero"):
    pytest.importorskip(_plugin)


def shapes_from_hf_config(cfg: dict) -> dict:
    """Both modules of a whole Qwen2.5-VL config, as the family describes them."""
    return shapes_for({"vision": cfg, "llm": cfg}, {"vision": "qwen2_5_vl", "llm": "qwen2_5_vl"})


VISION = dict(
    depth=4,
    hidden_size=32,
    intermediate_size=64,
    num_heads=4,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=16,
    fullatt_block_indexes=[1, 3],
    hidden_act="silu",
    out_hidden_size=48,
)
TEXT = dict(
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=391,
)


@pytest.fixture(scope="module")
def tower():
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg = Qwen2_5_VLConfig(vision_config=VISION, text_config=TEXT).vision_config
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2_5_VisionTransformerPretrainedModel(cfg).train()


def shape() -> EncoderShape:
    s = shapes_from_hf_config({"vision_config": VISION, "text_config": TEXT})["vision"]
    assert isinstance(s, EncoderShape)
    return s


def test_parameter_tensors_are_the_towers(tower):
    assert {t.name: t.shape for t in shape().tensors()} == {
        n: tuple(p.shape) for n, p in tower.named_parameters()
    }


def test_decoder_tensors_are_the_language_models():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    llm = shapes_from_hf_config({"vision_config": VISION, "text_config": TEXT})["llm"]
    model = Qwen2ForCausalLM(Qwen2Config(**TEXT, tie_word_embeddings=False))
    got = sorted(t.shape for t in llm.tensors())
    assert got == sorted(tuple(p.shape) for p in model.parameters())


def _one_step(tower, n_side: int) -> int:
    """Saved bytes of one forward of an n_side x n_side-patch image; then a backward and an AdamW step."""
    n = n_side * n_side
    saved = []
    with saved_bytes_hooks(tower, saved.append):
        out = tower(torch.randn(n, 3 * 2 * 4 * 4), grid_thw=torch.tensor([[1, n_side, n_side]])).pooler_output
    out.square().sum().backward()
    return sum(saved)


def test_weights_gathered_after_the_hooks_are_entered_are_not_counted(tower):
    """ZeRO-3 enters the hooks with its parameters partitioned (empty storage)
    and gathers them into new storage for the call: the gathered weights are
    model state, so the count equals the one with resident weights."""
    resident = _one_step(tower, 8)
    tower.zero_grad()
    full = [p.data for p in tower.parameters()]
    for p in tower.parameters():
        p.data = torch.empty(0)
    n = 64
    saved = []
    with saved_bytes_hooks(tower, saved.append):
        for p, d in zip(tower.parameters(), full):
            p.data = d.clone()  # the gather: new storage
        out = tower(torch.randn(n, 3 * 2 * 4 * 4), grid_thw=torch.tensor([[1, 8, 8]])).pooler_output
    out.square().sum().backward()
    assert sum(saved) == resident
    assert sum(saved) == predict(shape(), "ddp", 1, 1, n).activation_bytes


def test_state_and_activation_bytes_are_exact_in_fp32(tower):
    saved = _one_step(tower, 16)
    opt = torch.optim.AdamW(tower.parameters(), foreach=False)
    opt.step()
    # what Strategy.state_bytes counts: parameters, gradients, every optimizer-state tensor
    state = sum(p.numel() * 4 for p in tower.parameters())
    state += sum(p.grad.numel() * 4 for p in tower.parameters() if p.grad is not None)
    state += sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)
    )
    cost = predict(shape(), "ddp", 1, 1, 256)
    assert cost.state_bytes == state
    assert cost.activation_bytes == saved
    assert {"state_bytes"} <= set(cost.exact)


def test_ulysses_and_tp_split_what_they_should():
    s = shape()
    one = predict(s, "ddp", 1, 1, 1024)
    sp = predict(s, "ulysses", 4, 1, 1024)
    tp = predict(s, "megatron_tp", 4, 1, 1024)
    z3 = predict(
        s,
        "zero",
        1,
        4,
        1024,
        samples=4,
        options={"stage": 3, "ds_config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}},
    )
    assert sp.activation_bytes < one.activation_bytes / 4 * 1.01
    assert sp.activation_bytes < tp.activation_bytes < one.activation_bytes
    assert sp.state_bytes == one.state_bytes and tp.state_bytes < one.state_bytes
    # fp32 ZeRO-3: a parameter partition, its master copy, a gradient partition, two moments
    assert z3.state_bytes == 20 * sum(-(-t.numel // 4) for t in s.tensors())
    # window blocks move nothing under ulysses; TP all-reduces in every block
    assert set(sp.comm_bytes_by_kind) == {"all_to_all", "all_reduce"}
    assert sp.comm_bytes_by_kind["all_to_all"] < tp.comm_bytes_by_kind["all_reduce"]
    assert "comm_bytes" in sp.exact and "comm_bytes" in tp.exact


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown strategy 'fsdp'"):
        predict(shape(), "fsdp", 1, 1, 16)
    with pytest.raises(ValueError, match="'depth' is missing"):
        shapes_for({"vision": {k: v for k, v in VISION.items() if k != "depth"}}, {"vision": "qwen2_5_vl"})


def test_published_prediction_is_complete():
    rows = predict_published([4096, 65536])
    from disagg.bench.published import third_party_layouts
    from disagg.plugins import get_registry

    every = {**LAYOUTS_32B, **third_party_layouts(get_registry().strategies)}
    assert {(r["layout"], r["vision_tokens"]) for r in rows} == {
        (name, n) for name in every for n in (4096, 65536)
    }
    by = {(r["layout"], r["vision_tokens"]): r for r in rows}
    for n in (4096, 65536):
        assert (
            by[("dhp_ulysses_tp", n)]["groups"]["vision"]["comm_bytes"]
            < by[("uniform_tp", n)]["groups"]["vision"]["comm_bytes"]
        )
    assert by[("uniform_zero3", 65536)]["memory_per_gpu"] > by[("uniform_zero3", 4096)]["memory_per_gpu"]
    assert all(r["throughput_dhp_vs_tp"] > 1.0 for r in ratios(rows))
    assert shapes_from_hf_config(QWEN2_5_VL_32B)["llm"].layers == 64
