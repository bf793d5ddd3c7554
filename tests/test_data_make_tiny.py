"""``disagg make-tiny`` dirs load with transformers' Auto classes and the model classes, network off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disagg.plugins import get_registry

NEEDED = [("encoder", "qwen2_5_vl"), ("llm", "qwen2_5_vl"), ("llm", "qwen2"), ("llm", "llama")]
missing = [f"{r}:{n}" for r, n in NEEDED if (r, n) not in get_registry().families]
pytestmark = pytest.mark.skipif(bool(missing), reason=f"families not installed: {', '.join(missing)}")

#: what runs in the offline child: every dir through the Auto classes, its architecture, and its families
LOAD = r"""
import json, sys
from pathlib import Path
import transformers
from transformers import AutoConfig, AutoTokenizer, AutoImageProcessor, AutoFeatureExtractor
from disagg.plugins import get_registry

manifest = json.loads(Path(sys.argv[1]).read_text())
reg = get_registry()
# audio encoders size their projector to the LLM they feed: the tiny qwen2 here
llm_width = AutoConfig.from_pretrained(manifest["models"]["qwen2"]).hidden_size
report = {}
for name, path in manifest["models"].items():
    cfg = AutoConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    r = {"model_type": cfg.model_type, "vocab": len(tok), "chat": bool(tok.chat_template)}
    pre = Path(path) / "preprocessor_config.json"
    if pre.exists():
        kind = json.loads(pre.read_text())
        if "image_processor_type" in kind:
            r["image_processor"] = type(AutoImageProcessor.from_pretrained(path)).__name__
        if "feature_extractor_type" in kind:
            r["feature_extractor"] = type(AutoFeatureExtractor.from_pretrained(path)).__name__
    arch = getattr(transformers, cfg.architectures[0])
    model = arch.from_pretrained(path)
    r["architecture"] = type(model).__name__
    r["params"] = sum(p.numel() for p in model.parameters())
    r["families"] = {}
    for (role, fam), cls in reg.families.items():
        if fam == name:
            options = {"hidden_size": llm_width} if getattr(cls, "modality", None) == "audio" else {}
            module = cls(path, options).build()
            r["families"][role] = sum(p.numel() for p in module.parameters())
    report[name] = r
print("REPORT" + json.dumps(report))
"""


def offline_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    # belt and braces: any HTTP attempt would hit a closed port instead of the network
    env.update(HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9", NO_PROXY="")
    return env


def test_make_tiny_dirs_load_offline(tmp_path: Path):
    out = tmp_path / "tiny"
    cli = [
        sys.executable,
        "-m",
        "disagg.cli.main",
        "make-tiny",
        str(out),
        "--train-per-class",
        "1",
        "--eval-per-class",
        "1",
    ]
    done = subprocess.run(cli, env=offline_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"qwen2_5_vl", "qwen2", "llama"} <= set(manifest["models"])
    # one whole-VLM dir although qwen2_5_vl is registered for both roles
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted([*manifest["models"], "data"])

    load = subprocess.run(
        [sys.executable, "-c", LOAD, str(out / "manifest.json")],
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert load.returncode == 0, load.stderr[-3000:]
    report = json.loads(load.stdout.split("REPORT", 1)[1])
    vl = report["qwen2_5_vl"]
    assert vl["model_type"] == "qwen2_5_vl" and vl["architecture"] == "Qwen2_5_VLForConditionalGeneration"
    assert vl["image_processor"].startswith("Qwen2VLImageProcessor") and vl["chat"]
    # the vision and language families split the one dir: together they hold every parameter
    assert set(vl["families"]) == {"encoder", "llm"}
    assert vl["families"]["encoder"] + vl["families"]["llm"] == vl["params"]
    # every whole-VLM dir splits into its vision and language families (llava_clip: a
    # make-tiny variant of llava, read by families llava + llama)
    for name in ("qwen2_vl", "qwen3_vl"):
        r = report[name]
        assert r["model_type"] == name and r["families"]["encoder"] + r["families"]["llm"] == r["params"]
    assert report["llava_clip"]["model_type"] == "llava"
    for name in ("qwen2", "llama"):
        assert report[name]["model_type"] == name and report[name]["chat"]
        assert report[name]["families"]["llm"] == report[name]["params"]
    data = manifest["data"]
    assert Path(data["train"]).is_file() and Path(data["eval"]).is_file()
