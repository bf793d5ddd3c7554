"""The demo, shortened, in its ``--omni`` form: Qwen2.5-VL vision (``ulysses`` 2) +
Whisper audio (``ddp``) + Qwen2 LLM (``megatron_tp`` 2) from three dirs, trained on
image-only, audio-only, image+audio and text-only samples, must beat the
untrained model on held-out samples, answered by the modules rebuilt from the
export's manifest. It covers the plain demo's path too (vision ulysses, LLM
TP, export) at the cost of one run: the suite runs a single demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disagg.plugins import get_registry

ROOT = Path(__file__).resolve().parents[1]
reg = get_registry()
missing = [
    label
    for label, ok in (
        ("family encoder:qwen2_5_vl", ("encoder", "qwen2_5_vl") in reg.families),
        ("family llm:qwen2_5_vl", ("llm", "qwen2_5_vl") in reg.families),
        ("strategy ulysses", "ulysses" in reg.strategies),
        ("strategy megatron_tp", "megatron_tp" in reg.strategies),
        ("family encoder:whisper", ("encoder", "whisper") in reg.families),
        ("family llm:qwen2", ("llm", "qwen2") in reg.families),
    )
    if not ok
]
pytestmark = pytest.mark.skipif(bool(missing), reason=f"not installed: {', '.join(missing)}")

STEPS = int(os.environ.get("DISAGG_DEMO_TEST_STEPS", "120"))


def test_short_omni_demo_learns(tmp_path: Path):
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "demo" / "run.py"),
        "--omni",
        "--out",
        str(tmp_path),
        "--steps",
        str(STEPS),
        "--train-per-class",
        "10",
        "--eval-samples",
        "24",
        "--no-progress",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    result_file = tmp_path / "run" / "demo_result.json"
    assert result_file.exists(), done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(result_file.read_text())
    before, after, summary = result["before"], result["after"], result["summary"]
    assert after["n"] == {"all": 24, "image": 12, "audio": 12, "text": 6}, after["n"]
    # the untrained model answers nothing right; the trained one answers in the trained
    # form, naming colours, shapes and pitches of unseen drawings and tones (a short run:
    # the held-out scores are modest, the training loss is not)
    assert summary["last_loss"] < 0.2 * summary["first_loss"], summary
    assert after["exact_match"] > before["exact_match"], (before, after)
    score = lambda r: r["exact_match"] + r["colour_acc"] + r["shape_acc"] + r["pitch_acc"]  # noqa: E731
    assert score(after) >= score(before) + 0.75, (before, after)
    assert after["colour_acc"] > before["colour_acc"] and after["pitch_acc"] > before["pitch_acc"], after
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"run dir: {summary['run_dir']}" in done.stdout
    export = Path(result["export"])
    manifest = json.loads((export / "disagg_model.json").read_text())
    assert {m: e["family"] for m, e in manifest["modules"].items()} == {
        "vision": "qwen2_5_vl",
        "audio": "whisper",
        "llm": "qwen2",
    }
    for e in manifest["modules"].values():
        assert (export / e["path"] / "model.safetensors").is_file()
