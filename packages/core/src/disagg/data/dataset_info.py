"""LLaMA-Factory's ``dataset_info.json``: ``data.dataset_dir`` + ``data.train: NAME``.

A dataset is an entry of ``<dataset_dir>/dataset_info.json``; its rows are read as
LLaMA-Factory reads them (its ``data/README.md`` and data loader):

- ``file_name``: a file (or dir) under ``dataset_dir``; hub/script/cloud datasets are not read.
- ``formatting``: ``alpaca`` (the default) or ``sharegpt``.
- ``columns``: which row key holds what. Without it: ``prompt: instruction``, ``query: input``,
  ``response: output`` (alpaca), ``messages: conversations`` (sharegpt), and no ``system``,
  ``history``, ``images``, ``videos``, ``audios`` or ``tools`` column. As in LLaMA-Factory, a
  ``columns`` object replaces all of these: a column it does not name is not read.
- ``tags`` (sharegpt): the turn keys (``role_tag: from``, ``content_tag: value``) and role values
  (``user_tag: human``, ``assistant_tag: gpt``, ``system_tag: system``, ``observation_tag``,
  ``function_tag``); a ``tags`` object likewise replaces them all.
- alpaca: the user turn is ``prompt`` and ``query`` joined by a newline (an empty one left out),
  ``history`` holds earlier ``[prompt, response]`` pairs, whose responses are learned too.
- sharegpt: a first turn with ``system_tag`` is the system prompt (else the ``system`` column);
  user (or observation) turns at odd positions, assistant (or function) turns at even ones,
  ending with an assistant turn. Tool turns (observation, function) and ``tools`` are refused:
  disagg does not train tool use yet.
- Media paths are relative to ``dataset_dir`` (LLaMA-Factory's ``media_dir`` default) unless
  ``data.media_root`` is set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg.data.errors import DataError
from disagg.data.rows import Turns, content_text, history_turns, media_list

INFO_FILE = "dataset_info.json"
FORMATTINGS = ("alpaca", "sharegpt")
#: column -> LLaMA-Factory's default when the entry has no ``columns``
DEFAULT_COLUMNS = {
    "prompt": "instruction",
    "query": "input",
    "response": "output",
    "messages": "conversations",
}
COLUMNS = (
    "prompt",
    "query",
    "response",
    "history",
    "messages",
    "system",
    "tools",
    "images",
    "videos",
    "audios",
)
#: columns of LLaMA-Factory's preference (``ranking``) and KTO datasets: not supervised fine-tuning
PREFERENCE_COLUMNS = ("chosen", "rejected", "kto_tag")
DEFAULT_TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
#: entry keys that name data disagg does not read from a local dir
REMOTE_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
#: entry keys that change nothing for a local file's rows
IGNORED_KEYS = ("file_sha1", "split", "subset", "folder")
MEDIA_COLUMNS = {"image": "images", "audio": "audios", "video": "videos"}


@dataclass(frozen=True)
class Columns:
    """How one dataset_info.json entry's rows read (picklable: travels with each data job)."""

    name: str
    formatting: str
    columns: tuple[tuple[str, str | None], ...]
    tags: tuple[tuple[str, str | None], ...]

    def col(self, key: str) -> str | None:
        return dict(self.columns).get(key)

    def tag(self, key: str) -> str | None:
        return dict(self.tags).get(key)

    def describe(self) -> str:
        return f"{INFO_FILE} entry {self.name!r} (formatting: {self.formatting})"


def read_info(dataset_dir: str | Path) -> dict[str, Any]:
    path = Path(dataset_dir) / INFO_FILE
    if not path.is_file():
        raise DataError(str(path), f"no {INFO_FILE} in data.dataset_dir (LLaMA-Factory's dataset list)")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{exc.lineno}", f"malformed JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(info, dict):
        raise DataError(str(path), f"must be an object of named datasets, got {type(info).__name__}")
    return info


def resolve(dataset_dir: str | Path, name: str) -> tuple[str, Columns]:
    """The file of dataset ``name`` and how its rows read. Raises DataError naming the
    dataset_info.json key it cannot honour."""
    info = read_info(dataset_dir)
    where = str(Path(dataset_dir) / INFO_FILE)
    if name not in info:
        import difflib

        close = difflib.get_close_matches(name, list(info), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise DataError(where, f"no dataset {name!r} (it has: {', '.join(sorted(info)) or 'none'}){hint}")
    entry = info[name]
    here = f"{where}: {name}"
    if not isinstance(entry, dict):
        raise DataError(here, f"must be an object, got {type(entry).__name__}")
    remote = [k for k in REMOTE_KEYS if k in entry]
    if remote:
        raise DataError(here, f"'{remote[0]}' datasets are not read; download it and name it by 'file_name'")
    if not isinstance(entry.get("file_name"), str):
        raise DataError(here, "no 'file_name' (the dataset's file or dir, relative to data.dataset_dir)")
    unknown = sorted(
        set(entry)
        - {"file_name", "formatting", "columns", "tags", "ranking", "num_samples"}
        - set(IGNORED_KEYS)
    )
    if unknown:
        raise DataError(here, f"unknown key(s) {', '.join(map(repr, unknown))}")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        raise DataError(here, f"'formatting': {formatting!r} is not read; allowed: {', '.join(FORMATTINGS)}")
    if entry.get("ranking"):
        raise DataError(
            here, "'ranking': true (a preference dataset); disagg trains supervised fine-tuning only"
        )
    if entry.get("num_samples") is not None:
        raise DataError(here, "'num_samples' (a random subset) is not supported; remove it or cut the file")
    columns = _mapping(entry, "columns", here, COLUMNS + PREFERENCE_COLUMNS)
    tags = _mapping(entry, "tags", here, tuple(DEFAULT_TAGS))
    cols = {k: columns.get(k) for k in COLUMNS} if columns is not None else dict(DEFAULT_COLUMNS)
    pref = [k for k in PREFERENCE_COLUMNS if (columns or {}).get(k)]
    if pref:
        raise DataError(
            here, f"'columns': '{pref[0]}' (preference/KTO data); disagg trains supervised fine-tuning only"
        )
    tag_map = {k: tags.get(k) for k in DEFAULT_TAGS} if tags is not None else dict(DEFAULT_TAGS)
    needed = ("response",) if formatting == "alpaca" else ("messages",)
    for key in needed:
        if not cols.get(key):
            raise DataError(here, f"'columns' names no {key!r} column, which {formatting} rows need")
    if formatting == "alpaca" and not (cols.get("prompt") or cols.get("query")):
        raise DataError(here, "'columns' names neither a 'prompt' nor a 'query' column: alpaca rows need one")
    if formatting == "sharegpt":
        for key in ("role_tag", "content_tag", "user_tag", "assistant_tag"):
            if not tag_map.get(key):
                raise DataError(here, f"'tags' names no {key!r}, which sharegpt rows need")
    path = Path(dataset_dir) / entry["file_name"]
    if not path.exists():
        raise DataError(here, f"'file_name': {entry['file_name']!r} does not exist (looked for {path})")
    spec = Columns(name, formatting, tuple(cols.items()), tuple(tag_map.items()))
    return str(path), spec


def _mapping(entry: dict[str, Any], key: str, here: str, allowed: tuple[str, ...]) -> dict[str, Any] | None:
    value = entry.get(key)
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise DataError(here, f"'{key}' must be an object of strings")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise DataError(
            here, f"'{key}': unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed)}"
        )
    return value


def lf_turns(item: dict[str, Any], loc: str, spec: Columns) -> Turns:
    """One row of a dataset_info.json dataset, read as LLaMA-Factory reads it."""
    tools = spec.col("tools")
    if tools and item.get(tools):
        raise DataError(loc, f"'{tools}' (the tools column): tool use is not trained yet; remove it")
    out = _alpaca(item, loc, spec) if spec.formatting == "alpaca" else _sharegpt(item, loc, spec)
    for kind, column in MEDIA_COLUMNS.items():
        key = spec.col(column)
        if key:
            out.media[kind], out.keys[kind] = media_list(item.get(key), loc, key), f"'{key}'"
        else:
            out.media[kind] = []
            out.keys[kind] = f"{spec.describe()}, whose 'columns' name no '{column}' column"
    return out


def _system(item: dict[str, Any], loc: str, spec: Columns) -> str:
    key = spec.col("system")
    value = item.get(key) if key else None
    if value is not None and not isinstance(value, str):
        raise DataError(loc, f"'{key}' (the system column) must be a string, got {type(value).__name__}")
    return value or ""


def _alpaca(item: dict[str, Any], loc: str, spec: Columns) -> Turns:
    messages = (
        history_turns(item.get(spec.col("history")), loc, spec.col("history")) if spec.col("history") else []
    )
    parts = []
    for column in ("prompt", "query"):
        key = spec.col(column)
        value = item.get(key) if key else None
        if value is not None and not isinstance(value, str):
            raise DataError(
                loc, f"'{key}' (the {column} column) must be a string, got {type(value).__name__}"
            )
        if value:
            parts.append(value)
    key = spec.col("response")
    response = item.get(key)
    if not isinstance(response, str):
        got = "nothing" if response is None else type(response).__name__
        raise DataError(loc, f"'{key}' (the response column) must be a string, got {got}")
    system = _system(item, loc, spec)
    return Turns(
        [
            *([("system", system)] if system else []),
            *messages,
            ("user", "\n".join(parts)),
            ("assistant", response),
        ]
    )


def _sharegpt(item: dict[str, Any], loc: str, spec: Columns) -> Turns:
    key = spec.col("messages")
    turns = item.get(key)
    if not isinstance(turns, list) or not turns:
        raise DataError(loc, f"'{key}' (the messages column) must be a non-empty list of turns")
    role_tag, content_tag = spec.tag("role_tag"), spec.tag("content_tag")
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or role_tag not in t or content_tag not in t:
            raise DataError(
                loc, f"turn {i} must be an object with {role_tag!r} and {content_tag!r} (the tags)"
            )
    system_tag = spec.tag("system_tag")
    system = _system(item, loc, spec)
    if system_tag and turns[0][role_tag] == system_tag:
        system, turns = turns[0][content_tag], turns[1:]
        if not isinstance(system, str):
            raise DataError(loc, f"turn 0 (the system turn) must hold a string, got {type(system).__name__}")
    user, assistant = spec.tag("user_tag"), spec.tag("assistant_tag")
    tools = {spec.tag("observation_tag"), spec.tag("function_tag")} - {None}
    messages = [("system", system)] if system else []
    inline = []
    offset = len(item.get(key)) - len(turns)
    for j, t in enumerate(turns):
        role, want = t[role_tag], (user, "user") if j % 2 == 0 else (assistant, "assistant")
        if role in tools:
            raise DataError(
                loc, f"turn {j + offset} is a tool turn ({role_tag}: {role!r}); tool use is not trained yet"
            )
        if role != want[0]:
            raise DataError(
                loc,
                f"turn {j + offset} has {role_tag}: {role!r}, but turn {j + offset} must be the {want[1]}'s "
                f"({role_tag}: {want[0]!r}): {spec.describe()} reads user and assistant turns in turn "
                "(its 'tags' name the role values)",
            )
        text, refs = content_text(t[content_tag], loc, j + offset, repr(content_tag))
        messages.append((want[1], text))
        inline += refs
    if len(turns) % 2:
        raise DataError(
            loc,
            f"the last turn is the user's: {spec.describe()} needs the conversation to end with "
            "an assistant turn",
        )
    if inline:
        raise DataError(
            loc,
            f"media content parts: {spec.describe()} lists media in its media columns; use <image> markers",
        )
    return Turns(messages)


def entry_mismatch(loc: str, item: Any, spec: Columns) -> str | None:
    """Why the entry cannot describe the row at all (a key it names is not there), or None;
    the rows' own problems are each reported at their row when the stream reaches them."""
    if not isinstance(item, dict):
        return f"{loc}: a sample must be a JSON object, got {type(item).__name__}"
    keys = ", ".join(sorted(map(str, item))) or "none"
    if spec.formatting == "alpaca":
        need = [(c, spec.col(c)) for c in ("prompt", "response") if spec.col(c)]
    else:
        need = [("messages", spec.col("messages"))]
    for column, key in need:
        if key not in item:
            return (
                f"{loc}: the row has no {key!r}, which {spec.describe()} reads as its {column} column "
                f"(the row's keys: {keys}); fix the entry's 'columns'"
            )
    if spec.formatting == "sharegpt":
        turns = item[spec.col("messages")]
        first = turns[0] if isinstance(turns, list) and turns else None
        for tag in ("role_tag", "content_tag"):
            if isinstance(first, dict) and spec.tag(tag) not in first:
                shown = ", ".join(sorted(map(str, first))) or "none"
                return (
                    f"{loc}: turn 0 has no {spec.tag(tag)!r}, the entry's {tag} (the turn's keys: "
                    f"{shown}); fix the entry's 'tags'"
                )
    return None
