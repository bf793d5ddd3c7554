"""Dataset formats on the real tiny Qwen2.5-VL: a LLaMA-Factory file trains exactly as its
LLaVA twin, ``data.max_pixels`` reaches the image processor (``disagg data check`` counts
fewer vision tokens), and a video row stops ``disagg train`` with its file and line when PyAV is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from disagg.config.validate import validate
from disagg.plugins import get_registry

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

from mixed_data import make_mixed_tiny, mixed_config, to_sharegpt  # noqa: E402

STEPS = 2
DDP = {"strategy": "ddp"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tiny = make_mixed_tiny(tmp_path_factory.mktemp("tiny"), "qwen2_5_vl")
    tiny["sharegpt"] = str(to_sharegpt(Path(tiny["train"]), Path(tiny["media_root"]) / "mixed_lf.jsonl"))
    return tiny


def _config(tiny: dict, train: str, out: Path, **data):
    path = tiny["models"]["qwen2_5_vl"]
    model = {"vision": {"family": "qwen2_5_vl", "path": path}, "llm": {"family": "qwen2_5_vl", "path": path}}
    cfg = mixed_config(model, {"vision": DDP, "llm": DDP}, {**tiny, "train": train}, out, STEPS)
    return cfg.model_copy(update={"data": cfg.data.model_copy(update=data)}) if data else cfg


def test_llama_factory_file_trains_exactly_as_its_llava_twin(ray_local, tiny, tmp_path):
    from disagg.runtime.actor.state import read_module_state
    from disagg.runtime.run import run_training

    runs = {}
    for name in ("train", "sharegpt"):
        out = tmp_path / name
        run_training(validate(_config(tiny, tiny[name], out), get_registry()), progress=False)
        losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
        ckpt = out / "checkpoints" / f"step-{STEPS}"
        runs[name] = losses, {m: read_module_state(ckpt, m)[0] for m in ("vision", "llm")}
    (lv_losses, lv_state), (lf_losses, lf_state) = runs["train"], runs["sharegpt"]
    assert len(lv_losses) == STEPS and lf_losses == lv_losses  # exactly: the same tensors in
    for m in lv_state:
        assert all(torch.equal(lf_state[m][k], lv_state[m][k]) for k in lv_state[m]), m


def test_max_pixels_lowers_the_vision_tokens_data_check_counts(ray_local, tiny, tmp_path):
    from disagg.data.check import check_data
    from disagg.plugins import get_registry
    from disagg.runtime.plan import families_for

    reports = {}
    for max_pixels in (None, 16 * 16):
        cfg = _config(tiny, tiny["sharegpt"], tmp_path, max_pixels=max_pixels)
        reports[max_pixels] = check_data(cfg, families_for(cfg, get_registry()), progress=False)
    full, capped = reports[None]["media_tokens"]["vision"], reports[16 * 16]["media_tokens"]["vision"]
    # tiny Qwen2.5-VL: one token per 8x8 pixels, sides rounded to 8. The mixed data's images
    # (28x28, 56x28, 56x56) become 32x32, 56x32, 56x56: 16, 28, 49 tokens; 5 samples have
    # images, one of them small + wide (44). Capped at 16x16 pixels, the processor scales each
    # down and floors its sides to 8: 28x28 and 56x56 -> 16x16 (4 tokens), 56x28 -> 16x8 (2).
    assert (full["samples"], full["min"], full["max"]) == (5, 16, 49)
    assert (capped["samples"], capped["min"], capped["max"]) == (5, 2, 6)
    assert capped["mean"] < full["mean"]
    assert reports[16 * 16]["tokens"]["mean"] < reports[None]["tokens"]["mean"]


def test_train_refuses_a_video_row_with_its_line(ray_local, tiny, tmp_path, monkeypatch):
    """Qwen2.5-VL reads video, but not without PyAV: the run stops before any step, naming the
    row and the install line."""
    import disagg.data.source
    from disagg.data.formats import VideoError
    from disagg.data.video import INSTALL_HINT
    from disagg.runtime.run import run_training

    def no_av() -> None:
        raise ImportError(INSTALL_HINT)

    monkeypatch.setattr(disagg.data.source, "require_av", no_av)

    rows = Path(tiny["sharegpt"]).read_text().splitlines()
    video = {
        "messages": [
            {"role": "user", "content": "<video>What happens?"},
            {"role": "assistant", "content": "A."},
        ],
        "videos": ["clip.mp4"],
    }
    path = tmp_path / "with_video.jsonl"
    path.write_text("\n".join([*rows[:5], json.dumps(video), *rows[5:]]) + "\n")
    with pytest.raises(
        VideoError, match=rf"{path}:6: 1 sample\(s\) with video .* pip install 'disagg-core\[video\]'"
    ):
        run_training(validate(_config(tiny, str(path), tmp_path / "run"), get_registry()), progress=False)
    # refused before any step (and before the groups start: the data source is built first)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == ("failed", 0)
