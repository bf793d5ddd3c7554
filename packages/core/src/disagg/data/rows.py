"""One dataset row, in any accepted form, -> turns with ``<image>``/``<audio>`` markers and the
raw media references in marker order. Everything after this (placeholder counts, media files,
tokenization) is the same for every form, which is why each form trains exactly as its LLaVA twin.

The forms (:mod:`disagg.data.formats` tells them apart):

- ``llava`` / ``sharegpt``: ``conversations`` (``from``/``value``) or ``messages``
  (``role``/``content``); content may be a list of typed parts. A part that carries its
  file (Qwen's ``{"type": "image", "image": "a.png"}``, OpenAI's ``image_url``) brings its
  own media; a part without one (TRL's ``{"type": "image"}``) takes the next file of the
  row's media list.
- ``alpaca`` (LLaMA-Factory): ``instruction`` + ``input`` joined by a newline (the empty one
  left out) is the last user turn, ``output`` its answer, ``history`` earlier
  ``[prompt, answer]`` pairs (answers learned too), optional ``system``.
- ``query_response`` (ms-swift): ``query``/``response``/``history``, ``system`` (or
  ``system_prompt``); as ms-swift does, media items with no marker get one at the start of
  the first user turn.
- a LLaMA-Factory ``dataset_info.json`` entry (:class:`~disagg.data.dataset_info.Columns`):
  its ``columns`` name the row's keys and its ``tags`` the turns' keys and role values.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from disagg.data.errors import DataError
from disagg.data.formats import MEDIA_KEYS

#: media kind -> the text that marks where one item goes in a turn
PLACEHOLDERS: dict[str, str] = {"image": "<image>", "audio": "<audio>", "video": "<video>"}
#: accepted spellings of each role (LLaVA's ``from`` and chat ``role``)
ROLES: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
#: keys of an inline content part that may hold its file, per part type
PART_FILE_KEYS: dict[str, tuple[str, ...]] = {
    "image": ("image", "url", "path"),
    "image_url": ("image_url",),
    "audio": ("audio", "url", "path"),
    "video": ("video", "url", "path"),
    "video_url": ("video_url",),
}
#: the media kind of each content part type
PART_KIND = {"image_url": "image", "video_url": "video"}


@dataclass
class Turns:
    """A row read into one shape: ``messages`` of ``(role, text)`` (roles system/user/assistant,
    text with markers) and, per media kind, the raw references (file names, Hugging Face
    ``{"bytes", "path"}`` values) in marker order, with the key they came from (for errors)."""

    messages: list[tuple[str, str]]
    media: dict[str, list[Any]] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)


def to_turns(item: dict[str, Any], loc: str, fmt: str, columns: Any = None) -> Turns:
    """The row ``item`` (a dict) of row format ``fmt``, or of the dataset_info.json entry
    ``columns`` when given. Raises DataError at ``loc`` naming the key it cannot read."""
    if columns is not None:
        from disagg.data.dataset_info import lf_turns

        return lf_turns(item, loc, columns)
    if fmt == "alpaca":
        prompt = _join(item, loc, ("instruction", "input"))
        return _pairs(item, loc, prompt, _text(item, loc, "output"), "system", MEDIA_KEYS[fmt])
    if fmt == "query_response":
        system = "system" if "system" in item else "system_prompt"
        query, response = _text(item, loc, "query"), _text(item, loc, "response")
        out = _pairs(item, loc, query, response, system, MEDIA_KEYS[fmt])
        return with_default_markers(out)
    return _conversation(item, loc, fmt)


def _conversation(item: dict[str, Any], loc: str, fmt: str) -> Turns:
    turns = item.get("conversations", item.get("messages"))
    if turns is None:
        raise DataError(loc, "no 'conversations' or 'messages' list")
    if not isinstance(turns, list) or not turns:
        raise DataError(loc, "empty conversation: 'conversations'/'messages' must be a non-empty list")
    messages, inline = [], []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise DataError(loc, f"turn {i} must be an object, got {type(t).__name__}")
        role = t.get("from", t.get("role"))
        if role not in ROLES:
            raise DataError(loc, f"turn {i} has unknown role {role!r}; allowed: {', '.join(ROLES)}")
        text, refs = content_text(t.get("value", t.get("content")), loc, i, "'value'/'content'")
        messages.append((ROLES[role], text))
        inline += refs
    if fmt == "sharegpt" and item.get("system") is not None:
        system = item["system"]
        if not isinstance(system, str):
            raise DataError(loc, f"'system' must be a string, got {type(system).__name__}")
        if messages[0][0] == "system":
            raise DataError(loc, "both a 'system' key and a system turn; keep one")
        if system:
            messages.insert(0, ("system", system))
    out = Turns(messages)
    for kind in PLACEHOLDERS:
        key = MEDIA_KEYS[fmt][kind]
        out.media[kind], out.keys[kind] = media_list(item.get(key), loc, key), f"'{key}'"
    return merge_inline(out, inline, loc)


def content_text(content: Any, loc: str, i: int, key: str) -> tuple[str, list[tuple[str, Any]]]:
    """A turn's text with markers, and the ``(kind, file or None)`` of each media part in order."""
    refs: list[tuple[str, Any]] = []
    if isinstance(content, list):
        texts = []
        for part in content:
            text, ref = _part(part, loc, i)
            texts.append(text)
            if ref is not None:
                refs.append(ref)
        content = "".join(texts)
    if not isinstance(content, str):
        raise DataError(loc, f"turn {i} has no text: {key} must be a string, got {type(content).__name__}")
    return content, refs


def _part(part: Any, loc: str, i: int) -> tuple[str, tuple[str, Any] | None]:
    """One typed content part -> its text (a marker for media) and ``(kind, its file or None)``."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"], None
    if kind in PART_FILE_KEYS:
        media = PART_KIND.get(kind, kind)
        ref = next((part[k] for k in PART_FILE_KEYS[kind] if part.get(k)), None)
        if isinstance(ref, dict) and "url" in ref:  # OpenAI: {"image_url": {"url": ...}}
            ref = ref["url"]
        return PLACEHOLDERS[media], (media, None if ref is None else inline_ref(ref, loc, i))
    raise DataError(
        loc,
        f"turn {i} has a content part {part!r}; allowed types: text, image (its file under 'image'), "
        "image_url, audio (its file under 'audio'), video (its file under 'video'), video_url",
    )


def inline_ref(ref: Any, loc: str, i: int) -> Any:
    """A file named in a content part as a media reference: ``file://`` paths as paths,
    ``data:...;base64,`` URLs as their bytes; remote URLs are refused (nothing is downloaded)."""
    if isinstance(ref, dict):
        return ref  # a Hugging Face Image/Audio value
    if not isinstance(ref, str):
        raise DataError(loc, f"turn {i}: a media part's file must be a string, got {type(ref).__name__}")
    if ref.startswith("file://"):
        return ref[len("file://") :]
    if ref.startswith("data:") and ";base64," in ref:
        return {"bytes": base64.b64decode(ref.split(";base64,", 1)[1]), "path": None}
    if ref.startswith(("http://", "https://")):
        raise DataError(
            loc, f"turn {i}: media URL {ref!r} is not downloaded; save the file and name its path"
        )
    return ref


def merge_inline(out: Turns, inline: list[tuple[str, Any]], loc: str) -> Turns:
    """Media parts that carry their files are the row's media; parts without one take the row's
    media list in order. Both at once would leave the order ambiguous, so it is refused."""
    for kind in PLACEHOLDERS:
        files = [ref for k, ref in inline if k == kind]
        carried = [f for f in files if f is not None]
        if not carried:
            continue
        if len(carried) != len(files) or out.media[kind]:
            raise DataError(
                loc,
                f"some {kind} parts name their file and others do not (or {out.keys[kind]} lists "
                f"files too); name every {kind} in its part, or none and list them in {out.keys[kind]}",
            )
        out.media[kind], out.keys[kind] = carried, f"the {kind} content parts"
    return out


def with_default_markers(out: Turns) -> Turns:
    """ms-swift's rule for rows with fewer markers than media items: the missing markers go
    at the start of the first user turn."""
    first_user = next(k for k, (role, _) in enumerate(out.messages) if role == "user")
    for kind, marker in PLACEHOLDERS.items():
        missing = len(out.media.get(kind, [])) - sum(t.count(marker) for _, t in out.messages)
        if missing > 0:
            role, text = out.messages[first_user]
            out.messages[first_user] = (role, marker * missing + text)
    return out


def _pairs(
    item: dict[str, Any], loc: str, prompt: str, answer: str, system_key: str, media_keys: dict[str, str]
) -> Turns:
    """``history`` pairs, then (prompt, answer), under an optional system prompt."""
    messages = []
    system = item.get(system_key)
    if system is not None and not isinstance(system, str):
        raise DataError(loc, f"'{system_key}' must be a string, got {type(system).__name__}")
    if system:
        messages.append(("system", system))
    messages += history_turns(item.get("history"), loc, "history")
    messages += [("user", prompt), ("assistant", answer)]
    out = Turns(messages)
    for kind, key in media_keys.items():
        out.media[kind], out.keys[kind] = media_list(item.get(key), loc, key), f"'{key}'"
    return out


def history_turns(history: Any, loc: str, key: str) -> list[tuple[str, str]]:
    """``[[prompt, answer], ...]`` -> user/assistant turns (every answer is learned)."""
    if history is None:
        return []
    if not isinstance(history, list):
        raise DataError(
            loc, f"'{key}' must be a list of [prompt, answer] pairs, got {type(history).__name__}"
        )
    out = []
    for j, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise DataError(loc, f"'{key}'[{j}] must be a [prompt, answer] pair of strings, got {pair!r}")
        out += [("user", pair[0]), ("assistant", pair[1])]
    return out


def _text(item: dict[str, Any], loc: str, key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        got = "nothing" if value is None else type(value).__name__
        raise DataError(loc, f"'{key}' must be a string, got {got}")
    return value


def _join(item: dict[str, Any], loc: str, keys: tuple[str, ...]) -> str:
    """The non-empty of ``keys`` joined by newlines (LLaMA-Factory's ``instruction\\ninput``)."""
    parts = []
    for key in keys:
        value = item.get(key)
        if value is not None and not isinstance(value, str):
            raise DataError(loc, f"'{key}' must be a string, got {type(value).__name__}")
        if value:
            parts.append(value)
    return "\n".join(parts)


def media_list(value: Any, loc: str, key: str) -> list[Any]:
    """A media column's value (one file name or a list of them) as a list."""
    if value is None:
        return []
    if isinstance(value, (str, dict)):
        value = [value]
    if isinstance(value, list) and all(isinstance(v, (str, dict)) for v in value):
        return list(value)
    shown = repr(value) if len(repr(value)) < 200 else repr(value)[:200] + "..."
    raise DataError(loc, f"'{key}' must be a file name or a list of file names, got {shown}")
