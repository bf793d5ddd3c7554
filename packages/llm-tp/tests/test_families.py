"""Families and plugin wiring: registration, checks, placeholders, layer maps."""

from __future__ import annotations

import pytest
import torch
from tp_cases import family_cls

from disagg.kit.hf import allowed_head_degrees as allowed_degrees
from disagg.plugins import build_registry, make_plugin_manager
from disagg_llm_tp.strategy import MegatronTPOptions, MegatronTPStrategy


def test_plugin_registers_strategy_and_families():
    reg = build_registry(*make_plugin_manager())
    assert reg.strategies["megatron_tp"] is MegatronTPStrategy
    for name in ("qwen2", "llama", "qwen2_5_vl", "qwen2_vl", "qwen3_vl"):
        assert ("llm", name) in reg.families


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_placeholder_ids_come_from_config_or_tokenizer(tiny_dirs, family):
    fam = family_cls(family)(tiny_dirs[family])
    pid = fam.placeholder_token_id("vision")
    token = fam.tokenizer().convert_ids_to_tokens(pid)
    assert token == fam.placeholder_tokens["vision"]
    if family in ("qwen2_5_vl", "qwen2_vl", "qwen3_vl"):
        assert pid == fam.config.image_token_id


def test_check_names_value_and_allowed_degrees(tiny_dirs):
    fam = family_cls("qwen2")(tiny_dirs["qwen2"])  # 4 heads, 2 KV heads
    # the family declares its heads (layer_map().attention); the strategy that splits them checks
    opts = MegatronTPOptions()
    assert MegatronTPStrategy.check(fam, 2, 1, opts) == [] and MegatronTPStrategy.check(fam, 4, 1, opts) == []
    assert fam.check("megatron_tp", 3, 1) == []
    problems = MegatronTPStrategy.check(fam, 3, 1, opts)
    assert any("4 attention heads" in p and "degree 3" in p and "1, 2, 4" in p for p in problems)
    assert any("2 key/value heads" in p for p in problems)
    assert fam.check("ddp", 3, 1) == []
    assert allowed_degrees(8, 2) == [1, 2, 4, 8]
    assert allowed_degrees(12, 4) == [1, 2, 4, 12]


def test_scatter_count_mismatch_is_a_clear_error(tiny_dirs):
    fam = family_cls("llama")(tiny_dirs["llama"])
    pid = fam.placeholder_token_id("vision")
    ids = torch.tensor([30, pid, pid, 31])
    with pytest.raises(ValueError, match="2 placeholder tokens for 'vision' but its encoder produced 3 rows"):
        fam.forward(fam.build(), [{"input_ids": ids, "labels": ids}], [{"vision": torch.zeros(3, 64)}])


def test_layer_map_matches_module(tiny_dirs):
    from fnmatch import fnmatchcase

    for family in ("qwen2", "llama", "qwen2_5_vl", "qwen2_vl", "qwen3_vl"):
        fam = family_cls(family)(tiny_dirs[family])
        names = [n for n, _ in fam.build().named_modules()]
        lmap = fam.layer_map()
        for pat in (*lmap.column, *lmap.row, *lmap.vocab, *lmap.output):
            assert any(fnmatchcase(n, pat) for n in names), (family, pat)


def test_parts_match_and_cover_the_parameters(tiny_dirs):
    from disagg.kit.parts import matches

    for family in ("qwen2", "llama", "qwen2_5_vl", "qwen2_vl", "qwen3_vl"):
        fam = family_cls(family)(tiny_dirs[family])
        names = [n for n, _ in fam.build().named_parameters(remove_duplicate=False)]
        parts = fam.parts()
        for part, patterns in parts.items():
            assert any(matches(n, patterns) for n in names), (family, part)
        assert [n for n in names if not any(matches(n, p) for p in parts.values())] == [], family


def test_a_dir_of_another_model_type_is_named(tiny_dirs):
    (problem,) = family_cls("qwen2_5_vl")(tiny_dirs["qwen2_vl"]).check("megatron_tp", 2, 1)
    assert "is a 'qwen2_vl' model" in problem and "use family 'qwen2_vl'" in problem
    (problem,) = family_cls("qwen2")(tiny_dirs["llama"]).check("ddp", 1, 1)
    assert "is a 'llama' model" in problem and "use family 'llama'" in problem
