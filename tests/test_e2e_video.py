"""Video rows end to end: a Qwen2.5-VL run whose batches mix real encoded videos (PyAV, several
frames of different colors), images and text equals the single-process Hugging Face model fed
the same ``pixel_values_videos`` / ``video_grid_thw`` / ``second_per_grid_ts`` at every step,
with the tower under ``ulysses`` 2 (long videos split over its ranks like long images).

Step 1 holds a video row, an image row, a text row and a row with an image then a video (image
rows first, then video rows, in the vision module's output); a corrupt video before it is named
with its file:line and skipped (``data.on_error: skip``). Step 2 holds a video given as a Qwen
content part, text and an image.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

pytest.importorskip("av")
pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

from hf_reference import assert_run_matches_reference, train_reference  # noqa: E402
from video_data import qwen_video_kwargs, video_config, write_video_data  # noqa: E402

from disagg.config.validate import validate  # noqa: E402
from disagg.plugins import get_registry  # noqa: E402

STEPS = 2
#: per-frame pixel budget of the tiny tower (patch 4, merge 2): 6x8 patches per 64x48 frame
VIDEO = {"video_fps": 2.0, "video_max_frames": 8, "video_min_pixels": 64, "video_max_pixels": 1024}


def _config(tiny: dict, out: Path, vision: dict, llm: dict):  # noqa: ANN202
    return video_config(tiny, out, "qwen2_5_vl", vision, llm, VIDEO, STEPS)


@pytest.fixture(scope="module")
def video_run(ray_local, tmp_path_factory):
    """The tiny dir, the dataset, the run's batches (read once) and the HF reference run."""
    import transformers

    from disagg.cli.make_tiny import make_tiny
    from disagg.data import build_data_source
    from disagg.runtime.plan import families_for

    root = tmp_path_factory.mktemp("video")
    manifest = make_tiny(root / "tiny", ["qwen2_5_vl"], data=False)
    tiny = {"model": manifest["models"]["qwen2_5_vl"], **write_video_data(root / "data")}
    ddp = {"strategy": "ddp"}
    cfg = _config(tiny, tmp_path_factory.mktemp("ref"), ddp, ddp)
    source = build_data_source(cfg, families_for(cfg, get_registry()))
    batches = [
        [{m: ray.get(ref) for m, ref in s.inputs.items()} for s in batch]
        for _, batch in zip(range(STEPS), source.batches(0))
    ]
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tiny["model"], dtype=torch.float32
    )
    want = train_reference(model, batches, qwen_video_kwargs(model.config, seconds=True), cfg.train)
    return tiny, cfg, source, batches, want


def test_corrupt_video_is_named_and_skipped(video_run):
    from disagg.data.check import check_data, format_report
    from disagg.runtime.plan import families_for

    tiny, cfg, source, batches, _ = video_run
    line = f"{tiny['train']}:{tiny['broken_line']}"
    assert source.stats()["skipped"] == 1
    (problem,) = source.problems
    assert problem.startswith(f"{line}: cannot decode video ") and "broken.mp4" in problem, problem
    # the batches really mix video, image and text rows, and a row with both
    kinds = [[tuple(sorted(s.get("vision", {}))) for s in b] for b in batches]
    assert any("pixel_values_videos" in k and "pixel_values" not in k for k in kinds[0])
    assert any("pixel_values" in k and "pixel_values_videos" not in k for k in kinds[0])
    assert () in kinds[0] and any({"pixel_values", "pixel_values_videos"} <= set(k) for k in kinds[0])
    grids = [
        s["vision"]["video_grid_thw"].tolist()
        for b in batches
        for s in b
        if "video_grid_thw" in s.get("vision", {})
    ]
    assert [2, 6, 8] in [g for gs in grids for g in gs]  # clip.mp4: 4 frames -> t=2, 64x48 -> 24x32 px

    # disagg data check: each video row's sampled frames and tokens, the corrupt one named
    report = check_data(cfg, families_for(cfg, get_registry()), progress=False)
    f = tiny["train"]
    # clip.mp4: 10 frames at 4 fps -> 4 sampled, grid (2, 6, 8) -> 24 tokens; long.mp4: 12 at 3 fps
    # -> 8 (video_max_frames), 80x48 -> 24x40 px, grid (4, 6, 10) -> 60 tokens
    assert report["videos"] == [
        {"source": f"{f}:1", "frames": [4], "tokens": [24]},
        {"source": f"{f}:5", "frames": [8], "tokens": [60]},
        {"source": f"{f}:6", "frames": [8], "tokens": [60]},
    ]
    assert report["problems"] == [problem] and report["bad"] == 1
    assert f"{f}:5: 8 frames -> 60 tokens" in format_report(report)


def test_video_run_equals_hf_model_every_step(video_run, tmp_path):
    import transformers

    from disagg.runtime.run import run_training

    tiny, _, _, _, want = video_run
    run = tmp_path / "run"
    cfg = _config(tiny, run, {"strategy": "ulysses", "degree": 2}, {"strategy": "ddp"})
    run_training(validate(cfg, get_registry()), progress=False)
    assert len(want.losses) == STEPS
    hf_class = transformers.Qwen2_5_VLForConditionalGeneration
    assert_run_matches_reference(run, want, cfg.train, hf_class, "qwen2_5_vl video ulysses2")
