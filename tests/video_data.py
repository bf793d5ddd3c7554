"""Real encoded video files (PyAV) and a dataset that mixes video, image and text rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mixed_data import TRAIN

#: (red, green, blue) of each frame: every frame differs, so a wrong frame choice changes pixels
COLORS = [(255 * (k % 3 == 0), 255 * (k % 3 == 1), 40 * k % 256) for k in range(12)]


def write_video(path: Path, n_frames: int = 10, rate: int = 4, size: tuple[int, int] = (64, 48)) -> Path:
    """An mp4 of ``n_frames`` frames of different colors (a moving bar too), ``rate`` per second;
    libx264 where this PyAV build has it, else mpeg4."""
    import av

    w, h = size
    for codec in ("libx264", "mpeg4"):
        try:
            with av.open(str(path), "w", format="mp4") as c:
                s = c.add_stream(codec, rate=rate)
                s.width, s.height, s.pix_fmt = w, h, "yuv420p"
                for k in range(n_frames):
                    img = np.zeros((h, w, 3), np.uint8)
                    img[...] = COLORS[k % len(COLORS)]
                    img[:, (4 * k) % w : (4 * k) % w + 6] = 255
                    for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                        c.mux(p)
                for p in s.encode():
                    c.mux(p)
            return path
        except Exception:  # noqa: BLE001 - the next codec
            continue
    raise RuntimeError("neither libx264 nor mpeg4 encodes with this PyAV build")


def write_video_data(root: Path) -> dict[str, Any]:
    """Rows in file order (shuffle off): step 1 = video row, image row, text row, a corrupt video
    row (skipped) and a two-media row (image then video); step 2 = video (Qwen content part),
    text, image, text."""
    import random

    from disagg.data.demo_data import draw_shape

    root.mkdir(parents=True, exist_ok=True)
    write_video(root / "clip.mp4", n_frames=10, rate=4)
    write_video(root / "long.mp4", n_frames=12, rate=3, size=(80, 48))
    (root / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4)
    draw_shape("red", "square", 56, random.Random(0)).resize((56, 28)).save(root / "wide.png")

    def chat(prompt: str, answer: str, **media: Any) -> dict:
        return {
            "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
            **media,
        }

    rows = [
        chat("<video>What happens?", "Colors change.", videos=["clip.mp4"]),
        chat("<image>Describe.", "A red square.", images=["wide.png"]),
        chat("Answer briefly.", "Fine."),
        chat("<video>And here?", "Nothing.", videos=["broken.mp4"]),
        chat("<image>Then <video> this.", "A square, then colors.", images=["wide.png"], videos=["long.mp4"]),
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "video", "video": "long.mp4"}, {"type": "text", "text": "Which?"}],
                },
                {"role": "assistant", "content": "A moving bar."},
            ]
        },
        chat("Say hi.", "Hi."),
        chat("<image>Shape?", "Square.", images=["wide.png"]),
        chat("What now?", "Done."),
    ]
    path = root / "video.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"train": str(path), "media_root": str(root), "broken_line": 4}


def qwen_video_kwargs(config: Any, seconds: bool = False) -> Callable[[dict], dict]:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL's keywords for one sample, as their processors hand them
    over: image and video tensors, and ``mm_token_type_ids`` (1 image, 2 video) for mRoPE.
    ``seconds``: also ``second_per_grid_ts`` (Qwen2.5-VL's time axis; Qwen2-VL's
    ``get_rope_index`` counts temporal patches and takes none)."""
    keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    keys += ("second_per_grid_ts",) if seconds else ()

    def kwargs(s: dict) -> dict:
        ids = s["llm"]["input_ids"][None]
        kw = {"input_ids": ids, "labels": s["llm"]["labels"][None]}
        v = s.get("vision", {})
        kw.update({k: v[k] for k in keys if k in v})
        if v:
            kw["mm_token_type_ids"] = (ids == config.image_token_id).int() + 2 * (
                ids == config.video_token_id
            ).int()
        return kw

    return kwargs


def video_config(tiny: dict, out: Path, family: str, vision: dict, llm: dict, video: dict, steps: int) -> Any:
    """The validated config the video end-to-end tests train: ``family`` for both modules from
    the tiny dir, the mixed dataset (a broken video skipped), 2 microbatches, weight decay and
    clipping on, ``video``: the ``data.video_*`` settings."""
    from disagg.config.schema import Config
    from disagg.config.validate import validate
    from disagg.plugins import get_registry

    model = {m: {"family": family, "path": tiny["model"]} for m in ("vision", "llm")}
    cfg = Config.model_validate(
        {
            "model": model,
            "parallel": {"vision": vision, "llm": llm},
            "data": {
                "train": tiny["train"],
                "media_root": tiny["media_root"],
                "batch_size": 4,
                "shuffle": False,
                "num_workers": 1,
                "on_error": "skip",
                **video,
            },
            "train": {"steps": steps, **TRAIN},
            "checkpoint": {"every": 0},
            "output_dir": str(out),
        }
    )
    validate(cfg, get_registry())
    return cfg
