"""The demo dataset: coloured shapes with captions (and tones, with audio installed).

A task a tiny VLM learns in minutes on CPU: the caption names the colour and
the shape (``disagg.tiny.COLOURS`` x ``SHAPES``), whose words the tiny
tokenizers are trained on. With audio, tones of three pitches are captioned
by pitch, and ``omni_*.jsonl`` mixes image-only, audio-only, image+audio and
text-only samples in one file, for a vision + audio + LLM model. Everything
is drawn from a seed, so two machines generate byte-identical files. No
model code here: only files in the LLaVA-style format the pipeline reads, and a
LLaMA-Factory ``dataset_info.json`` naming the image splits (``demo_train``,
``demo_eval``), so the dir also works as ``data.dataset_dir``.
"""

from __future__ import annotations

import json
import math
import random
import wave
from pathlib import Path
from typing import Any

import numpy as np

from disagg.tiny import COLOURS, SHAPES

RGB = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 240),
    "yellow": (240, 220, 40),
    "white": (245, 245, 245),
    "black": (10, 10, 10),
}
IMAGE_PROMPT = "<image>\nDescribe the image."
AUDIO_PROMPT = "<audio>\nDescribe the sound."
BOTH_PROMPT = "<image><audio>\nDescribe the image and the sound."
#: text-only samples: the model learns to repeat a caption (it must still read text)
TEXT_PROMPT = "Repeat: {}"
#: tone captions by pitch; all three are in ``disagg.tiny.corpus()``
TONES = {"A low tone.": (180.0, 300.0), "A tone.": (400.0, 600.0), "A high tone.": (900.0, 1500.0)}


def caption(colour: str, shape: str) -> str:
    return f"A {colour} {shape}."


def draw_shape(colour: str, shape: str, size: int, rng: random.Random):
    """One RGB image: the shape at a jittered place and scale on a random mid-grey background
    (grey, so that both white and black shapes stand out)."""
    from PIL import Image, ImageDraw

    grey = rng.randint(100, 150)
    im = Image.new("RGB", (size, size), (grey, grey, grey))
    d = ImageDraw.Draw(im)
    # big and near the centre: a tiny vision tower must tell shapes apart in minutes
    extent = rng.uniform(0.6, 0.85) * size
    room = (size - extent) / 2
    cx = size / 2 + rng.uniform(-room, room) * 0.5
    cy = size / 2 + rng.uniform(-room, room) * 0.5
    x0, y0, x1, y1 = cx - extent / 2, cy - extent / 2, cx + extent / 2, cy + extent / 2
    fill = RGB[colour]
    if shape == "square":
        d.rectangle([x0, y0, x1, y1], fill=fill)
    elif shape == "circle":
        d.ellipse([x0, y0, x1, y1], fill=fill)
    elif shape == "triangle":
        d.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=fill)
    elif shape == "cross":
        w = extent / 3
        d.rectangle([cx - w / 2, y0, cx + w / 2, y1], fill=fill)
        d.rectangle([x0, cy - w / 2, x1, cy + w / 2], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; allowed: {', '.join(SHAPES)}")
    return im


def tone(freq: float, seconds: float, rate: int, rng: random.Random) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    amp = rng.uniform(0.3, 0.8)
    fade = np.minimum(1.0, np.minimum(t, t[-1] - t) / 0.02)  # no clicks at the ends
    return (amp * fade * np.sin(2 * math.pi * freq * t)).astype(np.float32)


def write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def make_demo_data(
    out_dir: str | Path,
    *,
    train_per_class: int = 10,
    eval_per_class: int = 2,
    image_size: int = 48,
    audio: bool = False,
    audio_rate: int = 16000,
    seed: int = 0,
) -> dict[str, Path]:
    """Write ``images/``, ``train.jsonl`` and ``eval.jsonl`` (and ``audio/``,
    ``audio_train.jsonl``, ``audio_eval.jsonl`` with ``audio``) under ``out_dir``;
    media paths in the JSONL are relative to ``out_dir`` (use it as ``data.media_root``).
    Returns the written dataset files by name."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for split, per_class, split_seed in (
        ("train", train_per_class, seed),
        ("eval", eval_per_class, seed + 10_000),
    ):
        rng = random.Random(split_seed)
        rows: list[dict[str, Any]] = []
        for k in range(per_class):
            for colour in COLOURS:
                for shape in SHAPES:
                    name = f"images/{split}_{colour}_{shape}_{k}.png"
                    draw_shape(colour, shape, image_size, rng).save(out / name)
                    rows.append(_sample("image", name, IMAGE_PROMPT, caption(colour, shape)))
        # one shuffled order in the file, so file order (shuffle off, eval) mixes classes
        random.Random(split_seed + 1).shuffle(rows)
        written[split] = _write_jsonl(out / f"{split}.jsonl", rows)
    _write_dataset_info(out)
    if audio:
        (out / "audio").mkdir(exist_ok=True)
        for split, per_class, split_seed in (
            ("train", train_per_class, seed),
            ("eval", eval_per_class, seed + 10_000),
        ):
            rng = random.Random(split_seed + 2)
            rows = []
            for _ in range(per_class):
                for text, (lo, hi) in TONES.items():
                    name = f"audio/{split}_{len(rows):04d}.wav"
                    write_wav(out / name, tone(rng.uniform(lo, hi), 0.5, audio_rate, rng), audio_rate)
                    rows.append(_sample("audio", name, AUDIO_PROMPT, text))
            written[f"audio_{split}"] = _write_jsonl(out / f"audio_{split}.jsonl", rows)
        for split in ("train", "eval"):
            written[f"omni_{split}"] = _write_omni(out, split, audio_rate, seed)
    return written


def _write_omni(out: Path, split: str, rate: int, seed: int) -> Path:
    """``omni_{split}.jsonl``: one sample per drawing of the split, in turn
    image-only, audio-only, image+audio and text-only, each with fresh tones,
    so every batch of four or more holds each kind."""
    images = [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]
    rng = random.Random(seed + (3 if split == "train" else 10_003))
    rows: list[dict[str, Any]] = []
    for i, img in enumerate(images):
        picture, said = img["image"], img["conversations"][1]["value"]
        kind = ("image", "audio", "both", "text")[i % 4]
        if kind in ("audio", "both"):
            text, (lo, hi) = rng.choice(list(TONES.items()))
            clip = f"audio/omni_{split}_{i:04d}.wav"
            write_wav(out / clip, tone(rng.uniform(lo, hi), 0.5, rate, rng), rate)
        if kind == "image":
            rows.append(_sample("image", picture, IMAGE_PROMPT, said))
        elif kind == "audio":
            rows.append(_sample("audio", clip, AUDIO_PROMPT, text))
        elif kind == "both":
            row = _sample("image", picture, BOTH_PROMPT, f"{said} {text}")
            rows.append({"audio": clip, **row})
        else:
            rows.append(
                {
                    "conversations": [
                        {"from": "human", "value": TEXT_PROMPT.format(said)},
                        {"from": "gpt", "value": said},
                    ]
                }
            )
    return _write_jsonl(out / f"omni_{split}.jsonl", rows)


def _sample(kind: str, path: str, prompt: str, answer: str) -> dict[str, Any]:
    return {
        kind: path,
        "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}],
    }


def _write_dataset_info(out: Path) -> None:
    """The image splits as LLaMA-Factory entries: its sharegpt defaults (``from``/``value``,
    ``human``/``gpt``) read the LLaVA rows, with the singular ``image`` key as the images column."""
    entry = {"formatting": "sharegpt", "columns": {"messages": "conversations", "images": "image"}}
    info = {f"demo_{split}": {"file_name": f"{split}.jsonl", **entry} for split in ("train", "eval")}
    (out / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n")


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
