"""Planning beyond Qwen2.5-VL, and a third party's cost hook, through ``disagg plan``
and ``disagg bench --predict`` (issue 24): a LLaVA config and a Whisper (audio)
config plan from their ``config.json`` values alone (each family describes its
module, ``Family.planning_shape``), and the example plugin's ``example_ddp``, which
states its own cost, is ranked beside the first-party strategies and predicted on
the published setting. Config values only: no weights, no actor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_audio")

#: LLaVA-1.5-7B's config values (CLIP ViT-L/14-336 + Llama-2-7B)
LLAVA = {
    "model_type": "llava",
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "vision_config": {
        "model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
        "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14, "image_size": 336,
    },
    "text_config": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
    },
}  # fmt: skip
#: Whisper-small's encoder config values and Qwen2-0.5B's
WHISPER = {
    "model_type": "whisper", "d_model": 768, "encoder_layers": 12, "encoder_attention_heads": 12,
    "encoder_ffn_dim": 3072, "num_mel_bins": 80, "max_source_positions": 1500,
}  # fmt: skip
QWEN2 = {
    "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
}  # fmt: skip


def _config(root: Path, model: dict) -> Path:
    for spec in model.values():
        d = root / spec["path"]
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(spec.pop("config")))
        spec["path"] = str(d)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump({"model": model, "output_dir": str(root / "run")}))
    return path


def _plan(config: Path, tmp: Path, *extra: str) -> list[dict]:
    from disagg.cli.main import main

    out = tmp / "plan.json"
    argv = [
        "plan",
        str(config),
        "--cluster",
        "h100x8",
        "--gpus",
        "4",
        "--samples",
        "4",
        "--text-tokens",
        "128",
    ]
    assert main([*argv, *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())["ranked"]


def test_llava_plans(tmp_path, capsys):
    cfg = _config(
        tmp_path,
        {
            "vision": {"family": "llava", "path": "llava", "config": LLAVA},
            "llm": {"family": "llama", "path": "llava", "config": LLAVA},
        },
    )
    ranked = _plan(cfg, tmp_path, "--vision-patches", "577")
    assert ranked and "best: vision=" in capsys.readouterr().out
    best = ranked[0]["groups"]
    # the CLIP tower's parameters (23 of its 24 layers run) and Llama-7B's, as the families list them
    assert best["vision"]["flops"] > 0 and best["llm"]["state_bytes"] > 0
    strategies = {m: {r["parallel"][m]["strategy"] for r in ranked} for m in ("vision", "llm")}
    assert {"ulysses", "megatron_tp"} <= strategies["vision"] and "megatron_tp" in strategies["llm"]


def test_whisper_plans_and_the_third_party_strategy_is_ranked(tmp_path):
    from disagg.plugins import get_registry

    if "example_ddp" not in get_registry().strategies:
        pytest.skip("the example plugin is not installed")
    cfg = _config(
        tmp_path,
        {
            "audio": {"family": "whisper", "path": "whisper", "config": WHISPER},
            "llm": {"family": "qwen2", "path": "qwen2", "config": QWEN2},
        },
    )
    ranked = _plan(cfg, tmp_path, "--audio-tokens", "1500")
    assert ranked
    # 1500 positions pooled by 2 (the family's default stride): 750 rows to the LLM
    first = ranked[0]["groups"]
    assert first["audio"]["sent_bytes"] % 750 == 0 and first["llm"]["flops"] > 0
    third = [
        r
        for r in ranked
        if "example_ddp" in {g["strategy"] for g in r["parallel"].values() if "strategy" in g}
    ]
    assert third, "example_ddp states its own cost: its layouts are ranked"
    assert ranked[0]["step_time_s"] == min(r["step_time_s"] for r in ranked)
    assert {
        r["groups"]["audio"]["exact"] == ["state_bytes"]
        for r in third
        if r["parallel"]["audio"]["strategy"] == "example_ddp"
    } <= {True}


def test_the_third_party_strategy_is_predicted_on_the_published_setting():
    from disagg.bench.published import LAYOUTS_32B, predict_published
    from disagg.plugins import get_registry

    strategies = get_registry().strategies
    if "example_ddp" not in strategies:
        pytest.skip("the example plugin is not installed")
    rows = predict_published([4096], recompute=("none",))
    layouts = {r["layout"] for r in rows}
    assert set(LAYOUTS_32B) <= layouts and "uniform_example_ddp" in layouts
    row = next(r for r in rows if r["layout"] == "uniform_example_ddp")
    # 8 whole replicas of a 32B model: state alone is 16 bytes per parameter, far over 80 GB
    assert not row["fits"] and row["groups"]["llm"]["state_bytes"] > 16 * 30e9


def _hf_params(module) -> dict[str, tuple[int, ...]]:  # type: ignore[no-untyped-def]
    return {n: tuple(p.shape) for n, p in module.named_parameters()}


def test_the_families_list_the_real_parameter_tensors():
    """Each family's planning shape lists the Hugging Face module's parameters, by
    name and shape (tiny configs of the same model types), so state bytes are exact."""
    from transformers import CLIPVisionConfig, CLIPVisionModel, WhisperConfig
    from transformers.models.qwen2_audio.configuration_qwen2_audio import Qwen2AudioEncoderConfig
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    from disagg_audio.families.shapes import qwen2_audio_shape, whisper_shape
    from disagg_vision_sp.families.shapes import llava_shape

    enc = dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=16)
    enc["max_source_positions"] = 30
    whisper = {n: s for n, s in _hf_params(WhisperEncoder(WhisperConfig(**enc))).items()}
    got = {t.name: t.shape for t in whisper_shape(enc, {}, 48).tensors()}
    assert {n: s for n, s in got.items() if not n.startswith("projector.")} == whisper
    assert got["projector.linear_1.weight"] == (48, 32)

    audio = Qwen2AudioEncoder(Qwen2AudioEncoderConfig(**enc))
    got = {
        t.name: t.shape
        for t in qwen2_audio_shape({"audio_config": enc, "text_config": {"hidden_size": 48}}).tensors()
    }
    assert {n: s for n, s in got.items() if not n.startswith("multi_modal_projector.")} == _hf_params(audio)

    vision = dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=3, patch_size=4
    )
    vision["image_size"] = 16
    clip = {
        n.removeprefix("vision_model."): s
        for n, s in _hf_params(CLIPVisionModel(CLIPVisionConfig(**vision))).items()
    }
    shape = llava_shape(
        {"vision_config": vision, "text_config": {"hidden_size": 48}, "vision_feature_layer": -2}
    )
    got = {t.name: t.shape for t in shape.tensors()}
    # layers past vision_feature_layer and the post-norm never run: not planned
    ran = {n: s for n, s in clip.items() if not n.startswith(("encoder.layers.2.", "post_layernorm"))}
    assert {n: s for n, s in got.items() if not n.startswith("multi_modal_projector.")} == ran
    assert shape.depth == 2 and got["multi_modal_projector.linear_2.weight"] == (48, 48)
