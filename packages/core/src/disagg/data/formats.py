"""Dataset row formats: which keys a row's media and turns are under, and telling them apart.

``llava`` (LLaVA-Instruct)::

    {"image": "a.png" | [...], "audio": "t.wav" | [...],
     "conversations": [{"from": "human", "value": "<image>\\nDescribe."}, {"from": "gpt", ...}]}

``sharegpt`` (LLaMA-Factory's sharegpt/openai styles, ms-swift, TRL)::

    {"messages": [{"role": "user", "content": "<image>Describe."}, {"role": "assistant", ...}],
     "images": ["a.png", ...], "audios": [...], "system": "optional system prompt"}

Both accept either turn spelling (``conversations``/``from``/``value`` or
``messages``/``role``/``content``, content also as a list of typed parts); the
media keys are what differ, singular in LLaVA, plural in ShareGPT, so a row
with media says which format it is. A key of the other format is refused, not
ignored: its media would otherwise be lost.

``alpaca`` (LLaMA-Factory, ms-swift)::

    {"instruction": "<image>Describe.", "input": "", "output": "A red square.",
     "images": ["a.png"], "system": "optional", "history": [["earlier prompt", "earlier answer"]]}

``query_response`` (ms-swift)::

    {"query": "<image>Describe.", "response": "A red square.", "images": ["a.png"],
     "history": [["earlier query", "earlier response"]], "system": "optional"}

How each reads into turns is :mod:`disagg.data.rows`. Qwen's inline content parts
(``{"type": "image", "image": "a.png"}``) carry their own media in either chat format.

Video is a media kind like the others (``video`` in LLaVA rows, ``videos`` in the
others, ``<video>`` markers, ``{"type": "video", "video": "a.mp4"}`` parts); it is
read by a vision family that ``reads_video`` (:mod:`disagg.data.video`). Where none
is configured, or PyAV is missing, such rows are refused up front
(:class:`VideoError`), never read as text.
"""

from __future__ import annotations

from typing import Any

from disagg.data.errors import DataError

#: row formats of JSON/JSONL files and Hugging Face datasets (``data.format``)
ROW_FORMATS = ("llava", "sharegpt", "alpaca", "query_response")
#: the formats whose rows are conversations (``conversations``/``messages``); they differ in
#: their media keys only
CHAT_FORMATS = ("llava", "sharegpt")
#: row format -> media kind -> the key its files are listed under
MEDIA_KEYS: dict[str, dict[str, str]] = {
    "llava": {"image": "image", "audio": "audio", "video": "video"},
    "sharegpt": {"image": "images", "audio": "audios", "video": "videos"},
    "alpaca": {"image": "images", "audio": "audios", "video": "videos"},
    "query_response": {"image": "images", "audio": "audios", "video": "videos"},
}
VIDEO_KEYS = ("video", "videos")
#: rows the driver reads to detect a format when the first ones have no media
DETECT_ROWS = 100


class VideoError(DataError):
    """A row with video the run cannot read (no video encoder, no PyAV): refused whatever
    ``data.on_error`` says (skipping would lose it silently)."""


def video_problem(item: Any) -> str | None:
    """Why ``item`` holds video, or None."""
    if not isinstance(item, dict):
        return None
    for key in VIDEO_KEYS:
        if item.get(key):
            return f"has '{key}'"
    turns = item.get("conversations", item.get("messages"))
    for turn in turns if isinstance(turns, list) else []:
        content = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        if isinstance(content, str) and "<video>" in content:
            return "has a <video> marker"
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") in ("video", "video_url"):
                return "has a video content part"
    return None


def row_format(item: Any) -> str | None:
    """The row's format as its keys say, None for a conversation row without media (LLaVA and
    ShareGPT read it alike).

    Raises ValueError for a row of no known form or one that uses both chat spellings."""
    if not isinstance(item, dict):
        raise ValueError(f"a sample must be a JSON object, got {type(item).__name__}")
    if "conversations" not in item and "messages" not in item:
        if "instruction" in item:
            return "alpaca"
        if "query" in item and "response" in item:
            return "query_response"
        keys = ", ".join(sorted(map(str, item))) or "none"
        raise ValueError(
            f"unknown row format (keys: {keys}); allowed: llava ('conversations' + 'image'/'audio'), "
            "sharegpt ('messages' or 'conversations' + 'images'/'audios'), alpaca ('instruction'/"
            "'input'/'output'), query_response ('query'/'response'/'history')"
        )
    found = [f for f in CHAT_FORMATS if any(item.get(k) is not None for k in MEDIA_KEYS[f].values())]
    if isinstance(item.get("system"), str):
        found = sorted(set(found) | {"sharegpt"})
    if len(found) > 1:
        raise ValueError(
            "ambiguous row: it has both llava keys ('image'/'audio'/'video') and sharegpt keys "
            "('images'/'audios'/'videos'/'system'); use one spelling, or set data.format"
        )
    if not found and _has_inline_media(item):
        return "sharegpt"  # Qwen's content parts name their own files: the chat form, no media key
    return found[0] if found else None


def _has_inline_media(item: dict[str, Any]) -> bool:
    turns = item.get("conversations", item.get("messages"))
    for turn in turns if isinstance(turns, list) else []:
        content = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and any(
                part.get(k) for k in ("image", "image_url", "audio", "video", "video_url", "url", "path")
            ):
                return True
    return False


def detect_format(rows: list[tuple[str, Any]]) -> tuple[str, str]:
    """``(format, how)`` from the first rows of a dataset: the first row with media decides.

    Raises DataError at the deciding row if it is ambiguous or not a conversation
    (the first row is always checked, so a file of another kind fails at line 1)."""
    for k, (loc, item) in enumerate(rows):
        try:
            fmt = row_format(item)
        except ValueError as exc:
            if k == 0 or "ambiguous" in str(exc):
                raise DataError(loc, f"data.format: auto: {exc}") from None
            continue  # a bad later row is reported at its own line when the stream reaches it
        if fmt is not None:
            return fmt, f"data.format: auto detected {fmt} from {loc}"
    # no media in the rows read: both formats read text-only rows alike
    first = rows[0][0] if rows else "the dataset"
    return "llava", f"data.format: auto found no media keys in the first {len(rows)} rows from {first}"


def other_format_key(item: dict[str, Any], fmt: str) -> str | None:
    """A media key of another chat format that ``item`` uses (``fmt`` is one of them), or None."""
    if fmt not in CHAT_FORMATS:
        return None
    for other in CHAT_FORMATS:
        if other == fmt:
            continue
        for key in MEDIA_KEYS[other].values():
            if item.get(key) is not None and key not in MEDIA_KEYS[fmt].values():
                return key
    if fmt == "llava" and item.get("system") is not None:
        return "system"
    return None


def format_of_key(key: str) -> str:
    if key == "system":
        return "sharegpt"
    return next(f for f in CHAT_FORMATS if key in MEDIA_KEYS[f].values())
