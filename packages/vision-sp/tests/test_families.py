"""Families: registration, tiny dirs, preprocessing, export back to the HF layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from disagg.plugins import build_registry, make_plugin_manager
from disagg_vision_sp.families.llava import LlavaVision
from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision
from disagg_vision_sp.families.qwen2_vl import Qwen2VLVision
from disagg_vision_sp.families.qwen3_vl import Qwen3VLVision
from disagg_vision_sp.testing import random_images
from disagg_vision_sp.ulysses.strategy import UlyssesStrategy


def test_entry_point_registers_strategy_and_families(monkeypatch):
    monkeypatch.setenv("DISAGG_PLUGINS", "vision_sp")  # only core + this plugin, like the isolation session
    reg = build_registry(*make_plugin_manager())
    assert reg.strategies["ulysses"] is UlyssesStrategy
    assert reg.family("encoder", "qwen2_5_vl") is Qwen2_5_VLVision
    assert reg.family("encoder", "llava") is LlavaVision
    assert reg.family("encoder", "qwen2_vl") is Qwen2VLVision
    assert reg.family("encoder", "qwen3_vl") is Qwen3VLVision
    assert "vision_sp" in reg.plugins and not reg.failures


@pytest.mark.parametrize("which", ["qwen", "llava"])
def test_export_state_names_match_the_dir(which, tiny_qwen, tiny_llava):
    path = tiny_qwen if which == "qwen" else tiny_llava
    family = (Qwen2_5_VLVision if which == "qwen" else LlavaVision)(path)
    state = family.build().state_dict()
    exported = family.export_state(state)
    stored = load_file(str(Path(path) / "model.safetensors"))
    assert set(exported) <= set(stored)
    for k, v in exported.items():
        assert torch.equal(v, stored[k]), k


def test_tiny_qwen_dir(tiny_qwen, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_qwen)
    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert cfg.vision_config.fullatt_block_indexes == [1, 3]
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}], tokenize=False
    )
    assert "<|vision_start|><|image_pad|><|vision_end|>" in text
    # deterministic for a seed: a second build has identical weights
    again = Qwen2_5_VLVision.make_tiny(tmp_path / "again")
    a, b = load_file(str(tiny_qwen / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_qwen_preprocess_and_tokens(tiny_qwen):
    family = Qwen2_5_VLVision(tiny_qwen)
    x = family.preprocess(random_images([(48, 32), (40, 24)]))
    assert x["image_grid_thw"].tolist() == [[1, 8, 12], [1, 6, 10]]
    assert x["pixel_values"].shape == (96 + 60, 3 * 2 * 4 * 4)
    assert family.num_tokens(x) == [24, 15]
    assert family.hidden_size() == 48
    out = family.encode(family.build(), x)
    assert out.shape == (39, 48)


def _families(tiny_qwen, tiny_llava, tiny_llava_clip, tiny_qwen2_vl, tiny_qwen3_vl) -> list:
    return [
        Qwen2_5_VLVision(tiny_qwen),
        LlavaVision(tiny_llava),
        LlavaVision(tiny_llava_clip),
        Qwen2VLVision(tiny_qwen2_vl),
        Qwen3VLVision(tiny_qwen3_vl),
    ]


def test_layer_maps_name_real_modules(tiny_qwen, tiny_llava, tiny_llava_clip, tiny_qwen2_vl, tiny_qwen3_vl):
    from fnmatch import fnmatch

    for family in _families(tiny_qwen, tiny_llava, tiny_llava_clip, tiny_qwen2_vl, tiny_qwen3_vl):
        names = [n for n, _ in family.build().named_modules()]
        lm = family.layer_map()
        for pattern in (*lm.column, *lm.row, *lm.heads):
            assert any(fnmatch(n, pattern) for n in names), (family.name, pattern)


def test_parts_match_and_cover_the_parameters(
    tiny_qwen, tiny_llava, tiny_llava_clip, tiny_qwen2_vl, tiny_qwen3_vl
):
    """Every documented part names real parameters, and the parts cover them all."""
    from disagg.kit.parts import matches

    for family in _families(tiny_qwen, tiny_llava, tiny_llava_clip, tiny_qwen2_vl, tiny_qwen3_vl):
        names = [n for n, _ in family.build().named_parameters()]
        parts = family.parts()
        for part, patterns in parts.items():
            assert any(matches(n, patterns) for n in names), (family.name, part)
        assert [n for n in names if not any(matches(n, p) for p in parts.values())] == [], family.name


def test_a_dir_of_another_model_type_names_the_family_that_reads_it(
    tiny_qwen, tiny_qwen2_vl, tiny_llava_clip
):
    """Today's raw AttributeError (a Qwen2-VL dir under qwen2_5_vl) is a sentence."""
    (problem,) = Qwen2_5_VLVision(tiny_qwen2_vl).check("ulysses", 2, 1)
    assert "is a 'qwen2_vl' model" in problem and "use family 'qwen2_vl'" in problem
    (problem,) = Qwen2VLVision(tiny_qwen).check("ulysses", 2, 1)
    assert "is a 'qwen2_5_vl' model" in problem and "use family 'qwen2_5_vl'" in problem
    assert LlavaVision(tiny_llava_clip).check("ulysses", 2, 1) == []  # CLIP towers are accepted


def test_qwen3_vl_rows_carry_the_deepstack_features(tiny_qwen3_vl):
    """encode = HF's merged embeddings, then each DeepStack feature, as columns."""
    from transformers import Qwen3VLForConditionalGeneration

    family = Qwen3VLVision(tiny_qwen3_vl)
    x = family.preprocess(random_images([(48, 32), (16, 16)]))
    hf = Qwen3VLForConditionalGeneration.from_pretrained(tiny_qwen3_vl)
    out = hf.model.get_image_features(x["pixel_values"], x["image_grid_thw"])
    # per image lists here; one tensor each in transformers 5.17 (the GPU host's)
    rows = [
        torch.cat(t) if isinstance(t, (list, tuple)) else t
        for t in [out.pooler_output, *out.deepstack_features]
    ]
    want = torch.cat(rows, -1)
    assert family.hidden_size() == 48 * 3 and want.shape == (28, 144)
    assert torch.equal(family.encode(family.build(), x), want)
