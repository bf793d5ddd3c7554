"""Qwen2-VL video rows end to end (issue 40): the Qwen2.5-VL video dataset (real encoded
videos, images, text, a corrupt video skipped) on a tiny Qwen2-VL dir, the tower under
``ulysses`` 2, equals the single-process ``Qwen2VLForConditionalGeneration`` fed the same
``pixel_values_videos`` / ``video_grid_thw`` (and ``mm_token_type_ids``) at every step.

Qwen2-VL's video is Qwen2.5-VL's (transformers' one ``Qwen2VLVideoProcessor`` serves both:
frame sampling, ``smart_resize``, temporal patches, the patch layout) except that its mRoPE
time axis counts temporal patches: its ``get_rope_index`` takes no ``second_per_grid_ts``, and
the reference is not given it either.
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


def _config(tiny: dict, out: Path, vision: dict):  # noqa: ANN202
    return video_config(tiny, out, "qwen2_vl", vision, {"strategy": "ddp"}, VIDEO, STEPS)


def test_qwen2_vl_video_run_equals_hf_model_every_step(ray_local, tmp_path):
    import transformers

    from disagg.cli.make_tiny import make_tiny
    from disagg.data import build_data_source
    from disagg.runtime.plan import families_for
    from disagg.runtime.run import run_training

    manifest = make_tiny(tmp_path / "tiny", ["qwen2_vl"], data=False)
    tiny = {"model": manifest["models"]["qwen2_vl"], **write_video_data(tmp_path / "data")}
    ref_cfg = _config(tiny, tmp_path / "ref", {"strategy": "ddp"})
    source = build_data_source(ref_cfg, families_for(ref_cfg, get_registry()))
    batches = [
        [{m: ray.get(ref) for m, ref in s.inputs.items()} for s in batch]
        for _, batch in zip(range(STEPS), source.batches(0))
    ]
    grids = [
        s["vision"]["video_grid_thw"].tolist()
        for b in batches
        for s in b
        if "video_grid_thw" in s.get("vision", {})
    ]
    # clip.mp4: 4 sampled frames -> 2 temporal patches of 6 x 8 patches (24 x 32 px)
    assert [2, 6, 8] in [g for gs in grids for g in gs], grids
    assert source.stats()["skipped"] == 1  # broken.mp4
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(tiny["model"], dtype=torch.float32)
    want = train_reference(model, batches, qwen_video_kwargs(model.config), ref_cfg.train)

    run = tmp_path / "run"
    cfg = _config(tiny, run, {"strategy": "ulysses", "degree": 2})
    run_training(validate(cfg, get_registry()), progress=False)
    assert len(want.losses) == STEPS
    hf_class = transformers.Qwen2VLForConditionalGeneration
    assert_run_matches_reference(run, want, cfg.train, hf_class, "qwen2_vl video ulysses2")
