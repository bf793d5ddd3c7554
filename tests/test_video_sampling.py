"""Frame sampling and video grids against Qwen's own processing, on real encoded files.

Reference: transformers' ``models/qwen2_vl/video_processing_qwen2_vl.py``
(``Qwen2VLVideoProcessor.sample_frames``, ``patchify``, ``smart_resize``) and
``video_utils.VideoMetadata.sampled_fps`` with ``Qwen2_5_VLProcessor``'s
``second_per_grid_ts = temporal_patch_size / sampled_fps``. That module imports
torchvision at its top (not installable beside our CPU torch), so its functions
are taken from the installed source file with ``ast`` and run as they are. The
frame count is also checked by hand against qwen-vl-utils' ``smart_nframes``
(``vision_process.py``: FPS 2, FPS_MIN_FRAMES 4, FRAME_FACTOR 2).
"""

from __future__ import annotations

import ast
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("av")
pytest.importorskip("disagg_vision_sp")

from video_data import write_video  # noqa: E402

from disagg.data.video import load_video, sample_indices  # noqa: E402


def _reference() -> SimpleNamespace:
    """transformers' own functions, run from its source file."""
    import transformers

    src = Path(transformers.__file__).parent / "models" / "qwen2_vl" / "video_processing_qwen2_vl.py"
    tree = ast.parse(src.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    found = {
        f.name: f
        for f in cls.body
        if isinstance(f, ast.FunctionDef) and f.name in ("sample_frames", "patchify")
    }
    found["smart_resize"] = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize"
    )
    assert set(found) == {"sample_frames", "patchify", "smart_resize"}, "transformers' video processor moved"
    ns: dict = {"math": math, "torch": torch, "VideoMetadata": object}
    for f in found.values():
        f.decorator_list = []
        code = ast.Module(body=[f], type_ignores=[])
        exec(compile(ast.fix_missing_locations(code), str(src), "exec"), ns)  # noqa: S102
    # the class defaults sample_frames reads from self (fps/num_frames: the call's own)
    defaults = SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=2, min_frames=4, max_frames=768)
    return SimpleNamespace(
        sample=lambda md, **kw: ns["sample_frames"](defaults, md, **kw),
        patchify=lambda v, **kw: ns["patchify"](None, v, **kw),
        smart_resize=ns["smart_resize"],
    )


REF = _reference()


@pytest.mark.parametrize(
    ("total", "video_fps", "fps", "max_frames"),
    [
        (10, 4.0, 2.0, 768),
        (12, 3.0, 2.0, 768),
        (300, 30.0, 2.0, 768),
        (300, 30.0, 2.0, 8),
        (7, 25.0, 2.0, 768),
        (90, 29.97, 1.0, 768),
        (1000, 24.0, 4.0, 64),
        (5, 5.0, 0.5, 768),
    ],
)
def test_sampled_frames_equal_transformers(total, video_fps, fps, max_frames):
    from transformers.video_utils import VideoMetadata

    md = VideoMetadata(total_num_frames=total, fps=video_fps)
    want = REF.sample(md, fps=fps, max_frames=max_frames).tolist()
    got = sample_indices(total, video_fps, fps=fps, max_frames=max_frames, factor=2)
    assert got == want
    # the count as qwen-vl-utils' smart_nframes says (by hand from its definition)
    n = min(max(total / video_fps * fps, 4), math.floor(min(max_frames, total) / 2) * 2, total)
    assert len(got) == math.floor(n / 2) * 2
    md = VideoMetadata(total_num_frames=total, fps=video_fps, frames_indices=want)
    assert len(got) / total * video_fps == pytest.approx(md.sampled_fps, rel=1e-12)


def test_video_inputs_equal_qwen_processing(tmp_path):
    """A real mp4: the decoded sampled frames, the grid, the patch layout and
    ``second_per_grid_ts`` as transformers computes them for the same frames and settings."""
    from PIL import Image
    from transformers import AutoImageProcessor
    from transformers.video_utils import VideoMetadata

    from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision

    tiny = Qwen2_5_VLVision.make_tiny(tmp_path / "qwen2_5_vl")
    fam = Qwen2_5_VLVision(tiny)
    path = write_video(tmp_path / "c.mp4", n_frames=12, rate=3, size=(80, 48))
    video = load_video(str(path), fps=2.0, max_frames=768, factor=2)
    assert video.indices == REF.sample(VideoMetadata(total_num_frames=12, fps=3.0), fps=2.0).tolist()
    # the frames kept are those frames of the file (each has its own color), decoded by PyAV
    import av

    with av.open(str(path)) as c:
        every = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(every) == video.total_frames == 12
    assert all((video.frames[k] == every[i]).all() for k, i in enumerate(video.indices))

    limits = {"min_pixels": 64, "max_pixels": 1024}
    got = fam.preprocess_video([video], **limits)
    cfg = fam.vision_config()
    patch, merge, tps = cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size
    h, w = REF.smart_resize(48, 80, factor=patch * merge, **limits)
    proc = AutoImageProcessor.from_pretrained(tiny)
    frames = torch.stack(
        [
            torch.from_numpy(np.asarray(Image.fromarray(f).resize((w, h), Image.Resampling.BICUBIC)))
            for f in video.frames
        ]
    )
    x = frames.permute(0, 3, 1, 2).float() * proc.rescale_factor
    x = (x - torch.tensor(proc.image_mean)[:, None, None]) / torch.tensor(proc.image_std)[:, None, None]
    want, t, gh, gw = REF.patchify(x[None], patch_size=patch, merge_size=merge, temporal_patch_size=tps)
    assert (
        got["video_grid_thw"].tolist() == [[t, gh, gw]] == [[len(video.indices) // 2, h // patch, w // patch]]
    )
    torch.testing.assert_close(got["pixel_values_videos"], want[0], rtol=0, atol=1e-6)
    sampled = VideoMetadata(total_num_frames=12, fps=3.0, frames_indices=video.indices).sampled_fps
    assert got["second_per_grid_ts"].tolist() == pytest.approx([tps / sampled])
    assert fam.num_tokens(got) == [t * gh * gw // merge**2]


def test_odd_frame_count_repeats_the_last_frame(tmp_path):
    """Fewer frames than a temporal patch: all are kept and the last repeated, as patchify pads."""
    from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision

    fam = Qwen2_5_VLVision(Qwen2_5_VLVision.make_tiny(tmp_path / "qwen2_5_vl"))
    video = load_video(str(write_video(tmp_path / "one.mp4", n_frames=1)), fps=2.0, max_frames=8, factor=2)
    assert video.indices == [0]
    got = fam.preprocess_video([video], min_pixels=64, max_pixels=1024)
    assert got["video_grid_thw"].tolist() == [[1, 6, 8]]
    rows = got["pixel_values_videos"].reshape(48, 3, 2, -1)
    torch.testing.assert_close(rows[:, :, 0], rows[:, :, 1])
