"""Qwen3-VL and Qwen3.5 video rows end to end (issue 40): the video dataset (real encoded videos,
images, text, a corrupt video skipped) on a tiny Qwen3-VL / Qwen3.5 dir, the tower under
``ulysses`` 2 (the Qwen3-VL decoder under ``ddp``, the Qwen3.5 one under ``megatron_tp`` 2 with
sequence parallelism), equals the single-process ``Qwen3VLForConditionalGeneration`` /
``Qwen3_5ForConditionalGeneration`` fed the same ``pixel_values_videos`` / ``video_grid_thw`` /
``input_ids`` (and ``mm_token_type_ids``) at every step. Qwen3.5 dirs have no processor of
their own (they ship Qwen3-VL's) and ``Qwen3_5Model.get_rope_index`` is Qwen3-VL's, so one
reference serves both; Qwen3.5's tower has no DeepStack and its decoder is hybrid.

The prompt and inputs are checked against transformers' own Qwen3-VL code (the parts that
import without torchvision): ``Qwen3VLVideoProcessor.sample_frames`` (the frames),
its ``smart_resize`` (the grid, over the whole video) and ``Qwen3VLProcessor.replace_video_token``
(per temporal patch ``<t seconds>`` and its own ``<|vision_start|>...<|vision_end|>``), since the
HF model, fed our ``input_ids``, cannot see a wrong timestamp.
"""

from __future__ import annotations

import types
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
#: Qwen3-VL's pixel budget is over the whole video (t_bar * h * w): 64x48 frames shrink
VIDEO = {"video_fps": 2.0, "video_max_frames": 8, "video_min_pixels": 64, "video_max_pixels": 3072}


#: family -> its HF class (in ``transformers``)
FAMILIES = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_5": "Qwen3_5ForConditionalGeneration"}
#: the decoder's layout per family: Qwen3-VL's under ddp; Qwen3.5's hybrid decoder (gated-delta-net
#: layers split by heads) under megatron_tp 2 with sequence parallelism, video tokens and all
DECODER = {
    "qwen3_vl": {"strategy": "ddp"},
    "qwen3_5": {"strategy": "megatron_tp", "degree": 2, "sequence_parallel": True},
}


def _config(tiny: dict, out: Path, vision: dict, family: str = "qwen3_vl", llm: dict | None = None):  # noqa: ANN202
    return video_config(tiny, out, family, vision, llm or {"strategy": "ddp"}, VIDEO, STEPS)


def _transformers_video(path: Path, config) -> tuple[list[int], str]:  # noqa: ANN001
    """The grid and prompt text transformers' Qwen3-VL code makes of ``path`` (frame count and
    rate read with PyAV, as its own PyAV loader reads them)."""
    import av
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
    from transformers.video_utils import VideoMetadata

    with av.open(str(path)) as c:
        s = c.streams.video[0]
        total, rate, h, w = s.frames, float(s.average_rate), s.height, s.width
    vp = types.SimpleNamespace(
        fps=VIDEO["video_fps"], min_frames=4, max_frames=VIDEO["video_max_frames"], merge_size=2
    )
    meta = VideoMetadata(total_num_frames=total, fps=rate)
    indices = Qwen3VLVideoProcessor.sample_frames(vp, meta, fps=VIDEO["video_fps"])
    meta.frames_indices = indices
    v = config.vision_config
    factor = v.patch_size * v.spatial_merge_size
    rh, rw = smart_resize(
        len(indices), h, w, temporal_factor=v.temporal_patch_size, factor=factor,
        min_pixels=VIDEO["video_min_pixels"], max_pixels=VIDEO["video_max_pixels"],
    )  # fmt: skip
    grid = [-(-len(indices) // v.temporal_patch_size), rh // v.patch_size, rw // v.patch_size]
    vp.temporal_patch_size = v.temporal_patch_size
    proc = types.SimpleNamespace(
        video_processor=vp,
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        video_token="<|video_pad|>",
    )
    proc._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(proc, *a)
    text = Qwen3VLProcessor.replace_video_token(
        proc, {"video_grid_thw": torch.tensor([grid]), "video_metadata": [meta]}, 0
    )
    return grid, text


@pytest.mark.parametrize("family", list(FAMILIES))
def test_qwen3_vl_video_run_equals_hf_model_every_step(ray_local, tmp_path, family):
    import transformers

    from disagg.cli.make_tiny import make_tiny
    from disagg.data import build_data_source
    from disagg.runtime.plan import families_for
    from disagg.runtime.run import run_training

    hf_class = getattr(transformers, FAMILIES[family])
    manifest = make_tiny(tmp_path / "tiny", [family], data=False)
    tiny = {"model": manifest["models"][family], **write_video_data(tmp_path / "data")}
    ref_cfg = _config(tiny, tmp_path / "ref", {"strategy": "ddp"}, family)
    source = build_data_source(ref_cfg, families_for(ref_cfg, get_registry()))
    batches = [
        [{m: ray.get(ref) for m, ref in s.inputs.items()} for s in batch]
        for _, batch in zip(range(STEPS), source.batches(0))
    ]
    assert source.stats()["skipped"] == 1  # broken.mp4
    model = hf_class.from_pretrained(tiny["model"], dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(tiny["model"])
    # the first row is clip.mp4's: 5 of 10 frames (odd: the last repeats) -> 3 temporal patches
    clip = batches[0][0]
    grid, text = _transformers_video(Path(tiny["media_root"]) / "clip.mp4", model.config)
    assert clip["vision"]["video_grid_thw"].tolist() == [grid] and grid[0] == 3, (clip["vision"], grid)
    assert text.count("seconds>") == 3
    assert text in tok.decode(clip["llm"]["input_ids"].tolist(), skip_special_tokens=False), text
    # long.mp4 (an image before it in one row; a Qwen content part in another)
    long_grid, long_text = _transformers_video(Path(tiny["media_root"]) / "long.mp4", model.config)
    rows = [s for b in batches for s in b if s.get("vision", {}).get("video_grid_thw") is not None]
    assert [s["vision"]["video_grid_thw"].tolist() for s in rows] == [[grid], [long_grid], [long_grid]]
    for s in rows[1:]:
        assert long_text in tok.decode(s["llm"]["input_ids"].tolist(), skip_special_tokens=False)

    want = train_reference(model, batches, qwen_video_kwargs(model.config), ref_cfg.train)
    run = tmp_path / "run"
    cfg = _config(tiny, run, {"strategy": "ulysses", "degree": 2}, family, DECODER[family])
    run_training(validate(cfg, get_registry()), progress=False)
    assert len(want.losses) == STEPS
    assert_run_matches_reference(run, want, cfg.train, hf_class, f"{family} video ulysses2")
