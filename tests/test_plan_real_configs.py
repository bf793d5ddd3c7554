"""Planning the models users train in 2026 from their published ``config.json``
alone (issue 40): each family's planning shape lists the Hugging Face module's
parameters (names and shapes on tiny configs, the exact count on the real config,
instantiated on the meta device), and ``disagg plan`` ranks the layouts of the real
configs. Config values only: no weights, no actor.

The configs under ``tests/configs/`` are the published ``config.json`` values; each
file's source is named in :data:`SOURCES`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

CONFIGS = Path(__file__).parent / "configs"
#: where each config's values were read (no download is possible here)
SOURCES = {
    # Qwen/Qwen3-VL-8B-Instruct config.json on the Hugging Face Hub, as quoted in
    # NVIDIA TensorRT-LLM's Qwen3-VL test (its 4-layer test copy says "36 layers for the
    # full model") and identically in the Cosmos-Reason2-8B port; the model card says 8.77B
    # parameters, which the meta-device count below reproduces (8,767,123,696).
    "qwen3_vl_8b.json": "huggingface.co/Qwen/Qwen3-VL-8B-Instruct/blob/main/config.json",
    # Qwen/Qwen2.5-Omni-7B config.json, its thinker_config (the talker and token2wav are never
    # planned): text and audio values as quoted in alibaba/rtp-llm's Qwen2.5-Omni thinker test,
    # the tower's as Qwen2.5-VL-7B's (1280 wide, 3420 MLP, 32 blocks, full attention at 7/15/23/31,
    # window 112, merger to 3584), the token ids and audio window (n_window 100, 1500 positions)
    # as transformers' Qwen2_5OmniThinkerConfig documents them for this checkpoint.
    "qwen2_5_omni_7b.json": "huggingface.co/Qwen/Qwen2.5-Omni-7B/blob/main/config.json",
}
OMNI = {"vision": "qwen2_5_omni", "audio": "qwen2_5_omni_audio", "llm": "qwen2_5_omni"}


def _config(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def _names(module: torch.nn.Module, prefix: str = "") -> dict[str, tuple[int, ...]]:
    return {n.removeprefix(prefix): tuple(p.shape) for n, p in module.named_parameters()}


def test_qwen3_vl_shapes_list_the_real_parameter_tensors():
    """Tiny Qwen3-VL: the tower's shape (DeepStack mergers included) and the decoder's
    (q/k norms, explicit head_dim, no q/k/v biases) name every HF parameter with its shape."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from disagg_llm_tp.families.shapes import qwen3_decoder_shape
    from disagg_vision_sp.families.shapes import qwen3_vl_shape

    cfg = {
        "model_type": "qwen3_vl",
        "text_config": dict(
            hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=100, attention_bias=False,
        ),
        "vision_config": dict(
            depth=3, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=48,
            num_position_embeddings=16, deepstack_visual_indexes=[0, 2], patch_size=4,
        ),
        "tie_word_embeddings": False,
    }  # fmt: skip
    config = Qwen3VLConfig(**cfg)
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    cfg = config.to_dict()  # every key, as a saved config.json has them
    vision = qwen3_vl_shape(cfg)
    assert {t.name: t.shape for t in vision.tensors()} == _names(model.model.visual)
    # each exchanged row: the merger's output and both DeepStack mergers'
    assert vision.out_hidden == 3 * 48
    decoder = qwen3_decoder_shape(cfg)
    got = {t.name: t.shape for t in decoder.tensors()}
    # the decoder shape's names leave out HF's ".self_attn" / ".mlp" levels (core's convention)
    want = {
        n.replace(".self_attn.", ".").replace(".mlp.", "."): s
        for n, s in _names(model.model.language_model).items()
    }
    want = {"lm_head.weight": (100, 48), **want}
    assert got == want and decoder.head_dim == 16


def test_qwen3_vl_8b_planning_shapes_count_every_parameter():
    """The published Qwen3-VL-8B config, built on the meta device by transformers:
    the tower's and the decoder's planning shapes hold exactly its parameters."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from disagg.cost.shapes import shapes_for

    cfg = _config("qwen3_vl_8b.json")
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**cfg))
    shapes = shapes_for({"vision": cfg, "llm": cfg}, {"vision": "qwen3_vl", "llm": "qwen3_vl"})
    planned = {m: sum(t.numel for t in s.tensors()) for m, s in shapes.items()}
    tower = sum(p.numel() for p in model.model.visual.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert planned == {"vision": tower, "llm": total - tower}
    assert total == 8_767_123_696  # the model card's 8.77B


def _plan(tmp: Path, model: dict, *extra: str, gpus: int = 4) -> dict:
    from disagg.cli.main import main

    for spec in model.values():
        d = tmp / spec.pop("config_dir")
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(spec.pop("config")))
        spec["path"] = str(d)
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump({"model": model, "output_dir": str(tmp / "run")}))
    out = tmp / "plan.json"
    argv = ["plan", str(config), "--cluster", "h100x8", "--gpus", str(gpus), "--samples", str(gpus)]
    assert main([*argv, "--text-tokens", "1024", *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_plan_ranks_qwen3_vl_8b(tmp_path, capsys):
    cfg = _config("qwen3_vl_8b.json")
    model = {m: {"family": "qwen3_vl", "config_dir": "qwen3_vl_8b", "config": cfg} for m in ("vision", "llm")}
    plan = _plan(tmp_path, model, "--vision-tokens", "16384")
    ranked = plan["ranked"]
    assert len(ranked) > 1 and "best: vision=" in capsys.readouterr().out
    assert ranked[0]["step_time_s"] == min(r["step_time_s"] for r in ranked)
    best = ranked[0]["groups"]
    # the tower sends 4 x 4096 columns per merged row (merger + 3 DeepStack mergers)
    assert best["vision"]["sent_bytes"] % (4 * 4096) == 0 and best["llm"]["flops"] > 0
    strategies = {m: {r["parallel"][m]["strategy"] for r in ranked} for m in ("vision", "llm")}
    assert {"ulysses", "megatron_tp"} <= strategies["vision"] and "megatron_tp" in strategies["llm"]


def test_qwen2_5_omni_shapes_list_the_real_parameter_tensors():
    """Tiny Qwen2.5-Omni thinker: the vision tower's shape (q/k/v apart) and the audio
    tower's (its own ln_post/proj tail, the bos/eos table) name every HF parameter."""
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    from disagg_audio.families.shapes import qwen2_5_omni_audio_shape
    from disagg_vision_sp.families.shapes import qwen2_5_omni_vision_shape

    config = Qwen2_5OmniThinkerConfig(
        text_config=dict(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
                           fullatt_block_indexes=[1], window_size=56),
        audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                          num_mel_bins=16, output_dim=48),
    )  # fmt: skip
    with torch.device("meta"):
        model = Qwen2_5OmniThinkerForConditionalGeneration(config)
    cfg = {"thinker_config": config.to_dict()}  # a whole Omni dir's nesting
    vision = {t.name: t.shape for t in qwen2_5_omni_vision_shape(cfg).tensors()}
    assert vision == _names(model.model.visual)
    audio = {t.name: t.shape for t in qwen2_5_omni_audio_shape(cfg).tensors()}
    assert audio == _names(model.model.audio_tower)


def test_qwen2_5_omni_7b_planning_shapes_count_every_parameter():
    """The published Qwen2.5-Omni-7B thinker on the meta device: the three modules'
    planning shapes hold exactly its parameters (vision, audio, and the rest: the LLM)."""
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    from disagg.cost.shapes import shapes_for

    cfg = _config("qwen2_5_omni_7b.json")
    with torch.device("meta"):
        model = Qwen2_5OmniThinkerForConditionalGeneration(Qwen2_5OmniThinkerConfig(**cfg["thinker_config"]))
    shapes = shapes_for(dict.fromkeys(OMNI, cfg), OMNI)
    planned = {m: sum(t.numel for t in s.tensors()) for m, s in shapes.items()}
    vision = sum(p.numel() for p in model.model.visual.parameters())
    audio = sum(p.numel() for p in model.model.audio_tower.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert planned == {"vision": vision, "audio": audio, "llm": total - vision - audio}
    assert total == 8_931_813_888


def test_plan_ranks_qwen2_5_omni_7b(tmp_path):
    cfg = _config("qwen2_5_omni_7b.json")
    model = {m: {"family": f, "config_dir": "qwen2_5_omni_7b", "config": cfg} for m, f in OMNI.items()}
    # 2 devices: three modules' layouts multiply (~50k on 2 devices, ~250k on 4); of 141 GB (H200):
    # on 2 x 80 GB nothing fits once the allocator's terms are counted (8.9B parameters x 18 B of
    # bf16 state = 160 GB, three processes' contexts and NCCL buffers on each device)
    plan = _plan(
        tmp_path, model, "--vision-tokens", "4096", "--audio-tokens", "1500", "--gpu-mem", "141GB", gpus=2
    )
    ranked = plan["ranked"]
    assert len(ranked) > 1 and ranked[0]["step_time_s"] == min(r["step_time_s"] for r in ranked)
    best = ranked[0]["groups"]
    assert set(best) == {"vision", "audio", "llm"} and all(best[m]["flops"] > 0 for m in best)
    # 1500 audio positions pooled by 2: 750 rows of the LLM's 3584 columns
    assert best["audio"]["sent_bytes"] % (750 * 3584) == 0


def test_parallel_auto_places_qwen3_vl_8b(tmp_path):
    """``parallel: auto`` on the published Qwen3-VL-8B config (config.json only): the planner's
    best layout replaces ``auto`` in the config (what ``disagg train`` then runs)."""
    from disagg.config.schema import Config
    from disagg.plan.auto import resolve_auto
    from disagg.plugins import get_registry

    d = tmp_path / "qwen3_vl_8b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_config("qwen3_vl_8b.json")))
    auto = {
        "cluster": "h100x8",
        "vision_tokens": 4096,
        "text_tokens": 1024,
        "strategies": ["ulysses", "megatron_tp"],
    }
    cfg = Config.model_validate(
        {
            "model": {m: {"family": "qwen3_vl", "path": str(d)} for m in ("vision", "llm")},
            "parallel": {"auto": auto},
            "data": {"train": str(tmp_path / "train.jsonl"), "batch_size": 8},
            "output_dir": str(tmp_path / "run"),
        }
    )
    placed, record = resolve_auto(cfg, get_registry())
    assert placed.parallel.auto is None and record["predicted"]["step_time_s"] > 0
    chosen = {m: getattr(placed.parallel, m).strategy for m in ("vision", "llm")}
    assert set(chosen.values()) <= {"ulysses", "megatron_tp"} and chosen == {
        m: record["chosen"]["parallel"][m]["strategy"] for m in ("vision", "llm")
    }
