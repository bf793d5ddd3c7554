"""Checks of the ``data`` section that need the families but no data: run by config validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from disagg.config.schema import Config
from disagg.interfaces import EncoderFamily

Problem = tuple[tuple[str | int, ...], str]


def data_problems(cfg: Config, families: dict[str, Any]) -> list[Problem]:
    """``(key path, message)`` for every data key the configured families cannot honour."""
    d = cfg.data
    out: list[Problem] = []
    if d.min_pixels is not None and d.max_pixels is not None and d.min_pixels > d.max_pixels:
        out.append(
            (("data", "min_pixels"), f"{d.min_pixels} is larger than data.max_pixels = {d.max_pixels}")
        )
    if (
        d.video_min_pixels is not None
        and d.video_max_pixels is not None
        and d.video_min_pixels > d.video_max_pixels
    ):
        out.append(
            (
                ("data", "video_min_pixels"),
                f"{d.video_min_pixels} is larger than data.video_max_pixels = {d.video_max_pixels}",
            )
        )
    image = [(m, f) for m, f in families.items() if isinstance(f, EncoderFamily) and f.modality == "image"]
    for key in ("min_pixels", "max_pixels"):
        if getattr(d, key) is None:
            continue
        if not image and families:
            out.append((("data", key), "is set but no image encoder is configured; remove it"))
        for m, fam in image:
            if not fam.pixel_limits:
                out.append(
                    (
                        ("data", key),
                        f"family {fam.name!r} (model.{m}) resizes every image to its fixed input size, "
                        "so it has no pixel budget to set; remove data." + key,
                    )
                )
    for key in ("video_min_pixels", "video_max_pixels"):
        for m, fam in image:
            if getattr(d, key) is not None and fam.reads_video and not fam.pixel_limits:
                out.append(
                    (
                        ("data", key),
                        f"family {fam.name!r} (model.{m}) resizes every video frame to its fixed input "
                        f"size, so it has no pixel budget to set; remove data.{key} (bound a video "
                        "with data.video_max_frames)",
                    )
                )
    entries = (
        [(("data", "train"), d.train, d.format)]
        if isinstance(d.train, str)
        else [(("data", "train", i, "path"), e.path, e.format or d.format) for i, e in enumerate(d.train)]
    )
    if d.eval:
        entries.append((("data", "eval"), d.eval, d.format))
    for path, file, fmt in entries:
        p = Path(file)
        if fmt == "hf" and p.is_file() and p.suffix != ".parquet":
            out.append(
                (
                    path,
                    f"{file!r} is a {p.suffix or 'plain'} file but data.format is hf (a Hugging Face dataset "
                    "dir or .parquet); use auto or a row format (llava, sharegpt, alpaca, query_response) "
                    "for JSON/JSONL",
                )
            )
    return out
