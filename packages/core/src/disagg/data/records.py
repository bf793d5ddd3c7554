"""Dataset rows into validated records: turns normalized, media resolved.

The row formats are described in :mod:`disagg.data.formats` and read into turns
by :mod:`disagg.data.rows`. Every structural problem (no media decoded yet) is
found here, with the row's location.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from disagg.data.errors import DataError
from disagg.data.formats import (
    CHAT_FORMATS,
    MEDIA_KEYS,
    ROW_FORMATS,
    VideoError,
    format_of_key,
    other_format_key,
    video_problem,
)
from disagg.data.rows import PLACEHOLDERS, ROLES, to_turns

__all__ = ["PLACEHOLDERS", "ROLES", "Record", "parse_sample", "read_dataset"]

#: why a video row is refused when no configured encoder reads video
NO_VIDEO = (
    "video is not supported yet by the configured model: no model.vision family that reads video "
    "(qwen2_5_vl does) with an LLM family that places it; remove video samples from the dataset"
)


@dataclass
class Record:
    """One structurally valid sample; media paths resolved and known to exist."""

    uid: int
    dataset: int
    source: str
    #: ``(role, text)`` with role in system/user/assistant; text keeps ``<image>``/``<audio>``/
    #: ``<video>`` markers
    messages: list[tuple[str, str]]
    #: media kind -> absolute paths (or the encoded bytes a Hugging Face dataset holds), in
    #: placeholder order
    media: dict[str, list[str | bytes]] = field(default_factory=dict)


def read_dataset(
    path: str | Path,
    media_root: str | Path,
    *,
    dataset: int,
    first_uid: int,
    modalities: set[str],
    on_bad: Callable[[DataError], None],
    fmt: str = "llava",
) -> list[Record]:
    """Records of one JSON/JSONL file. ``on_bad`` gets every bad sample's error
    (it raises for ``on_error: error`` and counts for ``skip``); a file that
    cannot be read at all always raises."""
    p = Path(path)
    if not p.is_file():
        raise DataError(str(path), "dataset file not found")
    text = p.read_text(encoding="utf-8")
    raw: list[tuple[str, Any]] = []
    if p.suffix == ".jsonl":
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            loc = f"{path}:{lineno}"
            try:
                raw.append((loc, json.loads(line)))
            except json.JSONDecodeError as exc:
                on_bad(DataError(loc, f"malformed JSON: {exc.msg} (column {exc.colno})"))
    else:
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path}:{exc.lineno}", f"malformed JSON: {exc.msg} (column {exc.colno})"
            ) from None
        if not isinstance(items, list):
            raise DataError(
                str(path), f"a .json dataset must be a list of samples, got {type(items).__name__}"
            )
        raw = [(f"{path}[{i}]", item) for i, item in enumerate(items)]

    out: list[Record] = []
    for loc, item in raw:
        try:
            messages, media = parse_sample(item, loc, Path(media_root), modalities, fmt)
        except DataError as exc:
            on_bad(exc)
            continue
        out.append(Record(first_uid + len(out), dataset, loc, messages, media))
    return out


def parse_sample(
    item: Any,
    loc: str,
    media_root: Path,
    modalities: set[str],
    fmt: str = "llava",
    how: str = "",
    columns: Any = None,
) -> tuple[list[tuple[str, str]], dict[str, list[str | bytes]]]:
    """Normalize one sample of row format ``fmt`` (or of the dataset_info.json entry
    ``columns``) and check everything that needs no decoding.

    ``how`` says why the dataset is read as ``fmt`` (for the error when a row is not)."""
    if not isinstance(item, dict):
        raise DataError(loc, f"a sample must be a JSON object, got {type(item).__name__}")
    if "video" not in modalities and (why := video_problem(item)):
        # refused, never skipped: a dataset of video would otherwise train as nothing
        raise VideoError(loc, f"sample {why}, but {NO_VIDEO}")
    if columns is None:
        _check_keys(item, loc, fmt, how)
    turns = to_turns(item, loc, fmt, columns)
    messages = turns.messages
    if "video" not in modalities and (turns.media.get("video") or any("<video>" in t for _, t in messages)):
        raise VideoError(loc, f"sample has video, but {NO_VIDEO}")  # under a dataset_info column
    if not any(role == "assistant" for role, _ in messages):
        raise DataError(loc, "no assistant ('gpt') turn: the sample has nothing to learn")

    media: dict[str, list[str | bytes]] = {}
    for kind, marker in PLACEHOLDERS.items():
        files, key = turns.media.get(kind, []), turns.keys.get(kind, f"the {kind} column")
        count = sum(text.count(marker) for _, text in messages)
        if count != len(files):
            raise DataError(
                loc, f"{count} {marker} placeholder(s) in the text but {len(files)} {kind} file(s) in {key}"
            )
        for role, text in messages:
            if role == "assistant" and marker in text:
                raise DataError(
                    loc, f"{marker} in an assistant turn; media may only appear in user/system turns"
                )
        if not files:
            continue
        if kind not in modalities:
            configured = ", ".join(sorted(modalities)) or "none"
            raise DataError(
                loc,
                f"sample has {kind} but no {kind} encoder is configured (media the model reads: "
                f"{configured})",
            )
        media[kind] = [_resolve(f, media_root, loc, kind) for f in files]
    return messages, media


def _check_keys(item: dict[str, Any], loc: str, fmt: str, how: str) -> None:
    """A key of another format is refused, not ignored: its media or turns would be lost."""
    other = other_format_key(item, fmt)
    if other is not None:
        raise DataError(
            loc,
            f"sample has {other!r}, a {format_of_key(other)} key, but the dataset is read as {fmt} "
            f"({how or 'data.format: ' + fmt}); set data.format: {format_of_key(other)} "
            f"(allowed: auto, {', '.join(ROW_FORMATS)}, hf)",
        )
    if fmt in CHAT_FORMATS:
        return
    for key in ("conversations", "messages"):
        if key in item:
            raise DataError(
                loc,
                f"sample has {key!r}, a conversation, but the dataset is read as {fmt} "
                f"({how or 'data.format: ' + fmt}); set data.format: sharegpt",
            )
    for kind, key in MEDIA_KEYS[fmt].items():
        if item.get(kind) is not None:
            raise DataError(loc, f"{fmt} rows list their {kind} files under {key!r}, not {kind!r}")


def _resolve(f: str | dict[str, Any], media_root: Path, loc: str, kind: str) -> str | bytes:
    """A file name under ``media_root`` -> its absolute path; a Hugging Face ``Image``/``Audio``
    value (``{"bytes", "path"}``) -> its bytes, or its path when it holds none."""
    if isinstance(f, dict):
        if f.get("bytes"):
            return bytes(f["bytes"])
        f = f.get("path") or ""
        if not f:
            feature = kind.capitalize()
            raise DataError(
                loc, f"an {kind} value (a Hugging Face {feature} feature) holds neither bytes nor a path"
            )
    full = (media_root / f).resolve()
    if not full.is_file():
        raise DataError(loc, f"missing {kind} file {f!r} (looked for {full})")
    return str(full)
