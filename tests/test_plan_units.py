"""One unit for vision tokens (issue 41): ``disagg plan`` on the README's GPU config counts
vision tokens as ``disagg data check`` does (the merged rows the LLM sees, not the encoder's
patches), and scores the config's own layout beside the best ones.

The model dir holds Qwen2.5-VL-3B's ``config.json`` (no weights) beside the tiny dir's
tokenizer and an image processor with the 3B's patch and merge sizes, so that one config
serves both commands; the sample's image is as large as the README's ``data.max_pixels``
allows (1,280 tokens)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

#: Qwen2.5-VL-3B-Instruct's config values; token ids are the tiny tokenizer's (its vocabulary)
QWEN25_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": True, "hidden_act": "silu", "attention_dropout": 0.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {
        "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
        "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
        "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2, "temporal_patch_size": 2,
    },
}  # fmt: skip


def _readme() -> tuple[dict, list[str]]:
    """The README's GPU config and its ``disagg plan`` command line."""
    text = (ROOT / "README.md").read_text()
    config = next(
        yaml.safe_load(m.group(2))
        for m in FENCE.finditer(text)
        if m.group(1) == "yaml" and "model:" in m.group(2) and "megatron_tp" in m.group(2)
    )
    plan = next(
        shlex.split(line.split("#")[0])[1:]
        for m in FENCE.finditer(text)
        if m.group(1) == "bash"
        for line in m.group(2).splitlines()
        if line.startswith("disagg plan ")
    )
    return config, plan


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from PIL import Image

    from disagg.cli.make_tiny import make_tiny

    root = tmp_path_factory.mktemp("units")
    make_tiny(root / "tiny", ["qwen2_5_vl"], train_per_class=1, eval_per_class=1)
    tiny = root / "tiny" / "qwen2_5_vl"
    model = root / "models" / "Qwen2.5-VL-3B-Instruct"
    model.mkdir(parents=True)
    for f in tiny.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, model / f.name)
    ids = {k: v for k, v in json.loads((tiny / "config.json").read_text()).items() if k.endswith("token_id")}
    (model / "config.json").write_text(json.dumps({**QWEN25_VL_3B, **ids}))
    proc = json.loads((tiny / "preprocessor_config.json").read_text())
    (model / "preprocessor_config.json").write_text(json.dumps({**proc, "patch_size": 14, "merge_size": 2}))
    data = root / "my_data"
    data.mkdir()
    Image.new("RGB", (1120, 896), (200, 30, 30)).save(data / "big.png")  # 40 x 32 tokens of 28 px
    row = {
        "image": "big.png",
        "conversations": [
            {"from": "human", "value": "<image>\nDescribe the image."},
            {"from": "gpt", "value": "A red rectangle."},
        ],
    }
    for split in ("train", "eval"):
        (data / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    return root


def _plan_json(argv: list[str], out: Path, capsys) -> tuple[str, dict]:  # type: ignore[no-untyped-def]
    from disagg.cli.main import main

    assert main([*argv, "--json", str(out)]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_plan_counts_vision_tokens_as_data_check_and_scores_the_config(
    workdir: Path, ray_local, monkeypatch, capsys
):
    from disagg.cli.main import main

    monkeypatch.chdir(workdir)
    config, plan_argv = _readme()
    config.pop("logging", None)  # trackers are not what this checks
    # absolute paths: the session's Ray workers started in another directory
    config["model"] = {m: {**s, "path": str(workdir / s["path"])} for m, s in config["model"].items()}
    for key in ("train", "eval", "media_root"):
        config["data"][key] = str(workdir / config["data"][key])
    config["output_dir"] = str(workdir / "run")
    Path("gpu.yaml").write_text(yaml.safe_dump(config))

    assert main(["data", "check", "gpu.yaml", "--no-progress", "--report", "report.json"]) == 0
    checked = json.loads(Path("report.json").read_text())["media_tokens"]["vision"]
    assert checked["min"] == checked["max"] == 1280  # data.max_pixels 1003520 / 28²
    capsys.readouterr()

    # the README's own command line (writing its best layout too), and the default
    # (data.max_pixels) give the same workload
    for argv in (
        [*plan_argv, "--write", "best.yaml"],
        [a for a in plan_argv if a not in ("--vision-tokens", "1280")],
    ):
        text, plan = _plan_json(argv, workdir / "plan.json", capsys)
        counted = re.search(r"(\d+) vision tokens \((\d+) patches\)", text)
        assert counted, text
        assert int(counted.group(1)) == checked["max"] and int(counted.group(2)) == 4 * checked["max"]
        # the config's own layout, scored by the same model as the candidates
        own = plan["own"]
        assert own["parallel"]["placement"] == config["parallel"]["placement"]
        assert own["parallel"]["llm"]["strategy"] == "megatron_tp"
        assert own["parallel"]["vision"]["degree"] == 2
        assert own["train"] == {"microbatches": 4, "schedule": "encoders_ahead"}
        line = next(x for x in text.splitlines() if x.startswith("yours: "))
        assert f"{own['step_time_s']:.4g} s/step" in line
        rank = 1 + sum(r["step_time_s"] < own["step_time_s"] for r in plan["ranked"])
        assert f"#{rank} of {len(plan['ranked'])} fitting layouts" in line

    # the planner's best (written by the first plan above) in the config scores as the best: the
    # same model both ways
    best = yaml.safe_load(Path("best.yaml").read_text())
    merged = {**config, "parallel": best["parallel"], "train": {**config["train"], **best["train"]}}
    Path("best_config.yaml").write_text(yaml.safe_dump(merged))
    text, plan = _plan_json(["plan", "best_config.yaml", *plan_argv[2:]], workdir / "plan2.json", capsys)
    assert plan["own"]["name"] == plan["ranked"][0]["name"]
    assert plan["own"]["step_time_s"] == pytest.approx(plan["ranked"][0]["step_time_s"], rel=1e-12)
    assert "#1 of" in next(x for x in text.splitlines() if x.startswith("yours: "))


def test_vision_sizes_convert_between_units(workdir: Path):
    """``--vision-patches`` is the encoder's positions: 4 per token under a 2x2 merge."""
    from disagg.config.schema import Config
    from disagg.plan.workload import DEFAULT_VISION_PATCHES, config_shapes, patches_per_image

    config, _ = _readme()
    model = str(workdir / "models" / "Qwen2.5-VL-3B-Instruct")
    config["model"] = {m: {**spec, "path": model} for m, spec in config["model"].items()}
    cfg = Config.model_validate(config)
    shapes = config_shapes(cfg)
    assert patches_per_image(cfg, shapes, vision_tokens=1280) == 5120
    assert patches_per_image(cfg, shapes, patches=5120) == 5120
    assert patches_per_image(cfg, shapes) == 5120  # data.max_pixels 1003520 = 1280 x 28²
    cfg.data.max_pixels = None
    assert patches_per_image(cfg, shapes) == DEFAULT_VISION_PATCHES
    with pytest.raises(ValueError, match="not both"):
        patches_per_image(cfg, shapes, vision_tokens=1, patches=4)
