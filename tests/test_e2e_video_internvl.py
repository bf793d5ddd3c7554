"""InternVL video rows end to end (issue 40): the video dataset (real encoded videos, images,
text, a corrupt video skipped, an image then a video in one row) on the tiny InternVL dir, the
tower under ``ulysses`` 2, equals the single-process ``InternVLForConditionalGeneration`` fed
what ``InternVLProcessor`` gives it (one ``pixel_values``: a sample's image tiles, then its
video frames, each frame one tile) at every step.

The frames, their pixels and the prompt are checked against transformers' own code, since the
HF model, fed our ``input_ids`` and tiles, cannot see a wrong frame choice or prompt:
``InternVLVideoProcessor.sample_frames`` (run from its source file: the module needs
torchvision) and ``InternVLProcessor.replace_video_token`` (``Frame{i}: <img>...</img>`` per
frame).
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("av")
pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

from hf_reference import assert_run_matches_reference, batches_of, train_reference  # noqa: E402
from video_data import video_config, write_video_data  # noqa: E402

from disagg.config.validate import validate  # noqa: E402
from disagg.plugins import get_registry  # noqa: E402

STEPS = 2
#: InternVL resizes every frame to one tile: no pixel budget
VIDEO = {"video_fps": 2.0, "video_max_frames": 8}


def _config(tiny: dict, out: Path, vision: dict):  # noqa: ANN202
    return video_config(tiny, out, "internvl", vision, {"strategy": "ddp"}, VIDEO, STEPS)


def _hf_kwargs(s: dict) -> dict:
    """What ``InternVLProcessor`` hands the model: one ``pixel_values``, tiles in text order
    (the rows put a sample's images before its videos)."""
    kw = {"input_ids": s["llm"]["input_ids"][None], "labels": s["llm"]["labels"][None]}
    v = s.get("vision", {})
    tiles = [v[k] for k in ("pixel_values", "pixel_values_videos") if k in v]
    if tiles:
        kw["pixel_values"] = torch.cat(tiles)
    return kw


def _sample_frames() -> callable:
    """transformers' ``InternVLVideoProcessor.sample_frames``, run from its source file."""
    import transformers

    src = Path(transformers.__file__).parent / "models" / "internvl" / "video_processing_internvl.py"
    tree = ast.parse(src.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "InternVLVideoProcessor")
    (f,) = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "sample_frames"]
    ns: dict = {"torch": torch, "VideoMetadata": object}
    exec(compile(ast.fix_missing_locations(ast.Module(body=[f], type_ignores=[])), str(src), "exec"), ns)  # noqa: S102
    defaults = SimpleNamespace(num_frames=None, fps=None, initial_shift=True)
    return lambda md, **kw: ns["sample_frames"](defaults, md, **kw).tolist()


def _transformers_video(path: Path, config, image_proc) -> tuple[torch.Tensor, str]:  # noqa: ANN001
    """The frames' tiles and the prompt text transformers' InternVL code makes of ``path``:
    ``sample_frames`` with ``num_frames = min(int(duration * fps), max_frames)``, the chosen
    frames (PyAV) resized to the tile and normalized, ``replace_video_token``."""
    import av
    from PIL import Image
    from transformers.models.internvl.processing_internvl import InternVLProcessor
    from transformers.video_utils import VideoMetadata

    with av.open(str(path)) as c:
        s = c.streams.video[0]
        total, rate = s.frames, float(s.average_rate)
        every = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    n = min(int(total / rate * VIDEO["video_fps"]), VIDEO["video_max_frames"])
    indices = _sample_frames()(VideoMetadata(total_num_frames=total, fps=rate), num_frames=n)
    side = config.vision_config.image_size[0]
    x = torch.stack(
        [
            torch.from_numpy(
                np.asarray(Image.fromarray(every[i]).resize((side, side), Image.Resampling.BICUBIC))
            )
            for i in indices
        ]
    )
    x = x.permute(0, 3, 1, 2).float() * image_proc.rescale_factor
    x = (x - torch.tensor(image_proc.image_mean)[:, None, None]) / torch.tensor(image_proc.image_std)[
        :, None, None
    ]
    # image_seq_length as InternVLProcessor's docstring defines it
    v = config.vision_config
    per_tile = int((v.image_size[0] // v.patch_size[0]) ** 2 * config.downsample_ratio**2)
    proc = SimpleNamespace(
        start_image_token="<img>",
        end_image_token="</img>",
        image_token="<IMG_CONTEXT>",
        image_seq_length=per_tile,
    )
    text = InternVLProcessor.replace_video_token(proc, {"pixel_values_videos": [x]}, 0)
    return x, text


def test_internvl_video_run_equals_hf_model_every_step(ray_local, tmp_path):
    import transformers

    from disagg.cli.make_tiny import make_tiny
    from disagg.runtime.run import run_training

    manifest = make_tiny(tmp_path / "tiny", ["internvl"], data=False)
    tiny = {"model": manifest["models"]["internvl"], **write_video_data(tmp_path / "data")}
    ref_cfg = _config(tiny, tmp_path / "ref", {"strategy": "ddp"})
    batches = batches_of(ref_cfg, STEPS)
    model = transformers.InternVLForConditionalGeneration.from_pretrained(tiny["model"], dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(tiny["model"])
    image_proc = transformers.AutoImageProcessor.from_pretrained(tiny["model"])
    media = Path(tiny["media_root"])
    rows = [s for b in batches for s in b if "pixel_values_videos" in s.get("vision", {})]
    # clip.mp4 alone; long.mp4 after an image; long.mp4 as a Qwen content part
    assert ["pixel_values" in s["vision"] for s in rows] == [False, True, False]
    for s, name in zip(rows, ("clip.mp4", "long.mp4", "long.mp4")):
        want, text = _transformers_video(media / name, model.config, image_proc)
        got = s["vision"]["pixel_values_videos"]
        assert s["vision"]["video_frames"].tolist() == [want.shape[0]], (name, s["vision"]["video_frames"])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        prompt = tok.decode(s["llm"]["input_ids"].tolist(), skip_special_tokens=False)
        assert text in prompt and text.count("Frame") == want.shape[0], (name, prompt)
    assert rows[0]["vision"]["video_frames"].tolist() == [5]  # 2.5 s at 2 fps; long.mp4: 8 (the cap)

    want = train_reference(model, batches, _hf_kwargs, ref_cfg.train)
    run = tmp_path / "run"
    cfg = _config(tiny, run, {"strategy": "ulysses", "degree": 2})
    run_training(validate(cfg, get_registry()), progress=False)
    assert len(want.losses) == STEPS
    hf_class = transformers.InternVLForConditionalGeneration
    assert_run_matches_reference(run, want, cfg.train, hf_class, "internvl video ulysses2")


def test_an_image_after_a_video_is_refused_with_its_row(tmp_path):
    """A sample's image tiles come before its video frames at the same tokens: a row whose text
    has an ``<image>`` after a ``<video>`` is named, not trained out of order."""
    from disagg.cli.make_tiny import make_tiny
    from disagg.data.errors import DataError
    from disagg.data.preprocess import preprocess_record
    from disagg.data.records import Record
    from disagg_llm_tp.families.internvl import InternVLLanguageFamily
    from disagg_vision_sp.families.internvl import InternVLVision

    path = make_tiny(tmp_path / "tiny", ["internvl"], data=False)["models"]["internvl"]
    data = write_video_data(tmp_path / "data")
    media = Path(data["media_root"])
    llm = InternVLLanguageFamily(path)
    rec = Record(
        0,
        0,
        "rows.jsonl:7",
        [("user", "<video>then<image>?"), ("assistant", "Both.")],
        {"image": [str(media / "wide.png")], "video": [str(media / "clip.mp4")]},
    )
    with pytest.raises(DataError, match=r"rows.jsonl:7.*<image> after a <video>"):
        preprocess_record(
            rec,
            {"vision": InternVLVision(path), "llm": llm},
            llm.tokenizer(),
            video={"fps": 2.0, "max_frames": 8},
        )


@pytest.mark.parametrize(
    ("total", "video_fps", "fps", "max_frames"),
    [(10, 4.0, 2.0, 8), (12, 3.0, 2.0, 8), (300, 30.0, 2.0, 768), (300, 30.0, 2.0, 8), (90, 29.97, 1.0, 768)],
)
def test_internvl_frames_equal_transformers(total, video_fps, fps, max_frames):
    from transformers.video_utils import VideoMetadata

    from disagg.data.video import sample_indices_internvl

    n = min(int(total / video_fps * fps), max_frames)
    want = _sample_frames()(VideoMetadata(total_num_frames=total, fps=video_fps), num_frames=n)
    assert sample_indices_internvl(total, video_fps, fps=fps, max_frames=max_frames) == want


def test_a_frame_pixel_budget_is_refused_for_internvl(tmp_path):
    from disagg.cli.make_tiny import make_tiny
    from disagg.config.validate import ConfigError

    tiny = {"model": make_tiny(tmp_path / "tiny", ["internvl"], data=False)["models"]["internvl"]}
    tiny.update(write_video_data(tmp_path / "data"))
    with pytest.raises(ConfigError, match=r"data\.video_max_pixels.*'internvl'.*fixed input size"):
        video_config(
            tiny,
            tmp_path / "run",
            "internvl",
            {"strategy": "ddp"},
            {"strategy": "ddp"},
            {**VIDEO, "video_max_pixels": 1024},
            STEPS,
        )
