"""Planning Qwen3.5 (issue 40) from its published ``config.json`` alone: the ``qwen3_5``
families' planning shapes list the Hugging Face module's parameters (names and shapes
on a tiny config with both layer kinds, the exact count on Qwen3.5-27B's, both built on
the meta device), and ``disagg plan`` ranks the 27B's layouts, the decoder under
``megatron_tp`` only at degrees that divide its gated-delta-net heads and its attention
heads. No weights, no actor.

``tests/configs/qwen3_5_27b.json``: Qwen/Qwen3.5-27B's config.json values
(huggingface.co/Qwen/Qwen3.5-27B/blob/main/config.json), as a public port quotes them
in full (text: 64 layers, every 4th full attention, 24 query / 4 key-value heads of 256,
a quarter rotated with interleaved mRoPE [11, 11, 10] at theta 1e7; 16 key / 48 value
linear-attention heads of 128, conv kernel 4; 5120 wide, MLP 17408, vocabulary 248320;
tower: 27 blocks of 1152, MLP 4304, 16 heads, patch 16, a 48 x 48 learned position grid,
merger to 5120, no DeepStack) and as THUDM/slime's scripts/models/qwen3.5-27B.sh sets the
same text values for Megatron. transformers builds it with 27,356,728,560 parameters
(the multi-token-prediction head the checkpoint also stores is not part of the HF model).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

CONFIG = Path(__file__).parent / "configs" / "qwen3_5_27b.json"
BOTH = {"vision": "qwen3_5", "llm": "qwen3_5"}


def _names(module: torch.nn.Module, prefix: str = "") -> dict[str, tuple[int, ...]]:
    return {n.removeprefix(prefix): tuple(p.shape) for n, p in module.named_parameters()}


def test_qwen3_5_shapes_list_the_real_parameter_tensors():
    """A tiny Qwen3.5 with both layer kinds and grouped value heads: every tower and decoder
    tensor under its own name and shape (the gated q_proj, conv1d, dt_bias, A_log, ...)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from disagg.cost.shapes import shapes_for

    config = Qwen3_5Config(
        text_config=dict(hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=100, linear_num_key_heads=2,
                         linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=4),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
                           num_position_embeddings=16, patch_size=4),
    )  # fmt: skip
    assert config.text_config.layer_types[-1] == "full_attention"  # layer 3 of every 4
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(config)
    cfg = config.to_dict()
    del cfg["text_config"]["layer_types"]  # the shape derives them as HF does
    shapes = shapes_for({"vision": cfg, "llm": cfg}, BOTH)
    assert {t.name: t.shape for t in shapes["vision"].tensors()} == _names(model.model.visual)
    decoder = _names(model, "model.language_model.")
    assert {t.name: t.shape for t in shapes["llm"].tensors()} == {
        k: v for k, v in decoder.items() if not k.startswith("model.visual.")
    }


def test_qwen3_5_27b_planning_shapes_count_every_parameter():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from disagg.cost.shapes import shapes_for

    cfg = json.loads(CONFIG.read_text())
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**cfg))
    shapes = shapes_for({"vision": cfg, "llm": cfg}, BOTH)
    planned = {m: sum(t.numel for t in s.tensors()) for m, s in shapes.items()}
    tower = sum(p.numel() for p in model.model.visual.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert planned == {"vision": tower, "llm": total - tower}
    assert total == 27_356_728_560


def test_plan_ranks_qwen3_5_27b(tmp_path, capsys):
    from disagg.cli.main import main

    d = tmp_path / "qwen3_5_27b"
    d.mkdir()
    (d / "config.json").write_text(CONFIG.read_text())
    config = tmp_path / "config.yaml"
    model = {m: {"family": "qwen3_5", "path": str(d)} for m in ("vision", "llm")}
    config.write_text(yaml.safe_dump({"model": model, "output_dir": str(tmp_path / "run")}))
    out = tmp_path / "plan.json"
    # 141 GB H200s
    argv = ["plan", str(config), "--cluster", "h200x8", "--gpus", "8", "--samples", "8"]
    argv += ["--placement", "collocated", "--strategies", "ulysses,megatron_tp,zero"]
    assert main([*argv, "--text-tokens", "1024", "--vision-tokens", "4096", "--json", str(out)]) == 0
    ranked = json.loads(out.read_text())["ranked"]
    assert len(ranked) > 1 and "best: vision=" in capsys.readouterr().out
    assert ranked[0]["step_time_s"] == min(r["step_time_s"] for r in ranked)
    best = ranked[0]["groups"]
    assert best["vision"]["sent_bytes"] % 5120 == 0 and best["llm"]["flops"] > 0
    strategies = {m: {r["parallel"][m]["strategy"] for r in ranked} for m in ("vision", "llm")}
    assert "ulysses" in strategies["vision"] and "megatron_tp" in strategies["llm"], strategies
    # gated-delta-net layers split by heads (16 key, 48 value), full attention by its 24 query heads
    degrees = {
        r["parallel"]["llm"]["degree"] for r in ranked if r["parallel"]["llm"]["strategy"] == "megatron_tp"
    }
    assert degrees and all(16 % d == 0 and 48 % d == 0 and 24 % d == 0 for d in degrees), degrees
