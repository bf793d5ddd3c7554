"""Where each sample of a dataset file is, without parsing any of them.

A JSONL file is indexed by the byte offset and length of every non-blank line
(a numpy scan of the file: 16 bytes per sample in the driver, no JSON parsed,
no Python object per sample), so data workers can read sample ``i`` by
seeking, and the driver's memory and start time do not depend on what the
samples hold. A ``.json`` list has no line structure to seek to: it is parsed
once here (a malformed file fails now, naming its line) and its items are kept
as JSON text in the driver; use JSONL for large datasets.
"""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from disagg.data.errors import DataError


@dataclass
class DatasetIndex:
    """One dataset file: ``size`` samples, each readable by :func:`read_entry`."""

    path: str
    media_root: str
    #: JSONL: byte offset, length and 1-based line number of each sample's line
    offsets: np.ndarray | None = None
    lengths: np.ndarray | None = None
    lines: np.ndarray | None = None
    #: ``.json``: the items re-encoded as JSON text
    items: list[str] | None = None

    @property
    def size(self) -> int:
        return len(self.offsets) if self.offsets is not None else len(self.items or [])

    def location(self, i: int) -> str:
        return f"{self.path}:{int(self.lines[i])}" if self.offsets is not None else f"{self.path}[{i}]"


def index_dataset(path: str | Path, media_root: str | Path) -> DatasetIndex:
    p = Path(path)
    if not p.is_file():
        raise DataError(str(path), "dataset file not found")
    if p.suffix != ".jsonl":
        return DatasetIndex(str(path), str(media_root), items=_json_items(p, str(path)))
    size = p.stat().st_size
    if size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return DatasetIndex(str(path), str(media_root), empty, empty, empty)
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        buf = np.frombuffer(m, dtype=np.uint8)
        ends = np.flatnonzero(buf == ord("\n"))
        if ends.size == 0 or ends[-1] != size - 1:
            ends = np.append(ends, size)  # last line without a newline
        starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64)
        lengths = (ends - starts).astype(np.int64)
        # whitespace-only lines are not samples (as json.loads would also refuse them); only
        # short lines can be blank, so only those are looked at
        keep = lengths > 0
        for j in np.flatnonzero(lengths < 8):
            keep[j] = bool(bytes(buf[starts[j] : starts[j] + lengths[j]]).strip())
        del buf
    lines = np.flatnonzero(keep).astype(np.int64) + 1
    return DatasetIndex(str(path), str(media_root), starts[keep], lengths[keep], lines)


def _json_items(p: Path, name: str) -> list[str]:
    try:
        items = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{name}:{exc.lineno}", f"malformed JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(items, list):
        raise DataError(name, f"a .json dataset must be a list of samples, got {type(items).__name__}")
    return [json.dumps(item) for item in items]


def read_entry(loc: str, path: str, offset: int, length: int, text: str) -> Any:
    """The parsed JSON of one sample: ``text`` (a ``.json`` item) or the JSONL
    line at ``offset``. Raises DataError at ``loc`` for malformed JSON."""
    if text:
        return json.loads(text)
    with open(path, "rb") as f:
        f.seek(offset)
        raw = f.read(length)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        msg = f"{exc.msg} (column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise DataError(loc, f"malformed JSON: {msg}") from None
