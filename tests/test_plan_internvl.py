"""Planning InternVL (issue 40) from its published ``config.json`` alone: the ``internvl``
vision family's planning shape lists InternViT's and the projector's parameters (names and
shapes on tiny configs covering both norm types, q/k norms, a mask token and a final
LayerNorm; the exact count on InternVL3-8B, built on the meta device by transformers), and
``disagg plan`` ranks InternVL3-8B's layouts. Config values only: no weights, no actor.

``tests/configs/internvl3_8b.json``: OpenGVLab/InternVL3-8B-hf's config.json
(huggingface.co/OpenGVLab/InternVL3-8B-hf/blob/main/config.json): InternViT-300M-448px-V2.5
(24 layers, 1024 wide, 16 heads, q/k/v biases, LayerNorm, 448 px tiles in 14 px patches)
and Qwen2.5-7B's decoder (28 layers, 3584 wide, 28 heads / 4 KV heads, vocabulary 151674,
untied); the model card's 7.94B parameters are reproduced below."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

CONFIG = Path(__file__).parent / "configs" / "internvl3_8b.json"


def _hf_names(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in _named(model).items()}


@pytest.mark.parametrize(
    "vision",
    [
        dict(attention_bias=True),
        dict(norm_type="rms_norm", use_qk_norm=True, use_mask_token=True, use_mean_pooling=False),
    ],
    ids=["internvit-300m", "internvit-6b-like"],
)
def test_internvl_shape_lists_the_real_parameter_tensors(vision):
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    from disagg_vision_sp.families.shapes_internvl import internvl_shape

    config = InternVLConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=56, patch_size=7, **vision),
        text_config=dict(model_type="qwen2", hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100),
    )  # fmt: skip
    with torch.device("meta"):
        model = InternVLForConditionalGeneration(config)
    shape = internvl_shape(config.to_dict())
    assert {t.name: t.shape for t in shape.tensors()} == _hf_names(model)
    assert shape.out_hidden == 48 and shape.merge == 2


def test_internvl3_8b_planning_shapes_count_every_parameter():
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    from disagg.cost.shapes import shapes_for

    cfg = json.loads(CONFIG.read_text())
    with torch.device("meta"):
        model = InternVLForConditionalGeneration(InternVLConfig(**cfg))
    shapes = shapes_for({"vision": cfg, "llm": cfg}, {"vision": "internvl", "llm": "internvl"})
    planned = {m: sum(t.numel for t in s.tensors()) for m, s in shapes.items()}
    vision = sum(p.numel() for p in _named(model).values())
    total = sum(p.numel() for p in model.parameters())
    assert planned == {"vision": vision, "llm": total - vision}
    assert total == 7_944_373_760  # the model card's 7.94B


def _named(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    inner = model.model
    out = dict(inner.vision_tower.named_parameters())
    out.update({f"multi_modal_projector.{n}": p for n, p in inner.multi_modal_projector.named_parameters()})
    return out


def test_plan_ranks_internvl3_8b(tmp_path, capsys):
    from disagg.cli.main import main

    d = tmp_path / "internvl3_8b"
    d.mkdir()
    (d / "config.json").write_text(CONFIG.read_text())
    config = tmp_path / "config.yaml"
    model = {m: {"family": "internvl", "path": str(d)} for m in ("vision", "llm")}
    config.write_text(yaml.safe_dump({"model": model, "output_dir": str(tmp_path / "run")}))
    out = tmp_path / "plan.json"
    # 16 tiles of 448 px per sample: 4096 rows to the LLM (16 x 1024 patch tokens in the tower)
    argv = ["plan", str(config), "--cluster", "h100x8", "--gpus", "4", "--samples", "4"]
    assert main([*argv, "--vision-tokens", "4096", "--text-tokens", "1024", "--json", str(out)]) == 0
    assert "best: vision=" in capsys.readouterr().out
    ranked = json.loads(out.read_text())["ranked"]
    assert len(ranked) > 1 and ranked[0]["step_time_s"] == min(r["step_time_s"] for r in ranked)
    best = ranked[0]["groups"]
    # the tower sends one row of the LLM's 3584 columns per 2x2 shuffled patches
    assert best["vision"]["sent_bytes"] % 3584 == 0 and best["llm"]["flops"] > 0
    strategies = {m: {r["parallel"][m]["strategy"] for r in ranked} for m in ("vision", "llm")}
    assert "ulysses" in strategies["vision"] and "megatron_tp" in strategies["llm"]
