"""Where each sample of a dataset file is, without parsing any of them.

A JSONL file is indexed by the byte offset and length of every non-blank line
(a numpy scan of the file: 16 bytes per sample in the driver, no JSON parsed,
no Python object per sample), so data workers can read sample ``i`` by
seeking, and the driver's memory and start time do not depend on what the
samples hold. A ``.json`` list has no line structure to seek to: it is parsed
once here (a malformed file fails now, naming its line) and its items are kept
as JSON text in the driver; use JSONL for large datasets. Parquet files and
Hugging Face dataset dirs are indexed by their row counts (:mod:`disagg.data.tables`).

Indexing also settles each dataset's row format (``data.format``, detected from
its first rows under ``auto``) and finds its video rows without parsing the
others: only lines that contain the bytes ``video`` are parsed.
"""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from disagg.data.errors import DataError
from disagg.data.formats import DETECT_ROWS


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
    #: row format (``llava`` / ``sharegpt``) and how it was chosen, for messages
    format: str = "llava"
    how: str = ""
    #: parquet / Hugging Face dataset dir: the table's files and rows per file
    table: Any = None
    #: a LLaMA-Factory dataset_info.json entry's columns and tags (:mod:`disagg.data.dataset_info`)
    columns: Any = None

    @property
    def size(self) -> int:
        if self.table is not None:
            return self.table.size
        return len(self.offsets) if self.offsets is not None else len(self.items or [])

    def location(self, i: int) -> str:
        if self.table is not None:
            return self.table.location(i)
        return f"{self.path}:{int(self.lines[i])}" if self.offsets is not None else f"{self.path}[{i}]"

    def spec(self) -> DatasetSpec:
        return DatasetSpec(self.path, self.media_root, self.format, self.how, self.table, self.columns)

    def first_rows(self, n: int) -> list[tuple[str, Any]]:
        """``(location, parsed row)`` of those of the first ``n`` rows that parse (for format
        detection; a malformed one is reported at its line when the stream reaches it)."""
        out = []
        for i in range(min(n, self.size)):
            try:
                out.append((self.location(i), self.read(i)))
            except DataError:
                continue
        return out

    def read(self, i: int) -> Any:
        if self.table is not None:
            return self.table.row(i)
        if self.offsets is not None:
            return read_entry(self.location(i), self.path, int(self.offsets[i]), int(self.lengths[i]), "")
        return json.loads(self.items[i])

    def video_rows(self) -> list[str]:
        """Locations of the rows that hold video (refused up front where the run cannot read video)."""
        if self.table is not None:
            return self.table.video_rows()
        if self.items is not None:
            cand = [i for i, t in enumerate(self.items) if "video" in t]
        else:
            cand = _lines_containing(self.path, b"video", self.offsets)
        return [self.location(i) for i in cand if _has_video(self, i)]


@dataclass(frozen=True)
class DatasetSpec:
    """What a data worker needs to read one dataset's rows (small: sent with every job)."""

    path: str
    media_root: str
    format: str
    how: str
    table: Any = None
    columns: Any = None


def index_dataset(
    path: str | Path, media_root: str | Path, fmt: str = "auto", columns: Any = None
) -> DatasetIndex:
    """Index one dataset and settle its row format (``fmt``: a ``data.format`` value; ``columns``:
    a dataset_info.json entry's, which decides it)."""
    from disagg.data.formats import detect_format
    from disagg.data.tables import open_table

    p = Path(path)
    table = open_table(p) if p.is_dir() or p.suffix == ".parquet" else None
    if fmt == "hf" and table is None:
        raise DataError(
            str(path),
            "data.format: hf needs a Hugging Face dataset dir (save_to_disk) or parquet file(s); "
            "for a JSON/JSONL file use auto or a row format (llava, sharegpt, alpaca, query_response)",
        )
    if table is not None:
        ix = DatasetIndex(str(path), str(media_root), table=table)
    else:
        ix = _index_json(p, str(path), str(media_root))
    if columns is not None:
        ix.columns = columns
        ix.format, ix.how = columns.formatting, columns.describe()
    elif fmt in ("auto", "hf"):
        ix.format, ix.how = detect_format(ix.first_rows(DETECT_ROWS)) if ix.size else ("llava", "")
        if table is not None:
            ix.how += f" ({table.kind})"
    else:
        ix.format, ix.how = fmt, f"data.format: {fmt}"
    return ix


def index_jsonl(path: str) -> DatasetIndex:
    """The line index of one JSONL file (a file of a Hugging Face dataset dir)."""
    return _index_json(Path(path), path, "")


def _index_json(p: Path, path: str, media_root: str) -> DatasetIndex:
    if not p.is_file():
        raise DataError(path, "dataset file not found")
    if p.suffix != ".jsonl":
        return DatasetIndex(path, media_root, items=_json_items(p, path))
    size = p.stat().st_size
    if size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return DatasetIndex(path, media_root, empty, empty, empty)
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
    return DatasetIndex(path, media_root, starts[keep], lengths[keep], lines)


def _lines_containing(path: str, needle: bytes, offsets: np.ndarray) -> list[int]:
    """Indices of the samples whose line contains ``needle`` (a C-speed scan of the file)."""
    hits = []
    with open(path, "rb") as f:
        if not offsets.size:
            return []
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            at = m.find(needle)
            while at != -1:
                i = int(np.searchsorted(offsets, at, side="right")) - 1
                hits.append(i)
                # next line: one hit per sample is enough
                nxt = int(offsets[i + 1]) if i + 1 < len(offsets) else len(m)
                at = m.find(needle, max(nxt, at + 1))
    return sorted(set(h for h in hits if h >= 0))


def _has_video(ix: DatasetIndex, i: int) -> bool:
    from disagg.data.formats import video_problem

    try:
        return video_problem(ix.read(i)) is not None
    except (DataError, ValueError):
        return False  # malformed: reported at its line when the stream reaches it


def _json_items(p: Path, name: str) -> list[str]:
    try:
        items = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{name}:{exc.lineno}", f"malformed JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(items, list):
        raise DataError(name, f"a .json dataset must be a list of samples, got {type(items).__name__}")
    return [json.dumps(item) for item in items]


def read_entry(loc: str, path: str, offset: int, length: int, text: str, table: Any = None) -> Any:
    """The parsed JSON of one sample: ``text`` (a ``.json`` item), the JSONL line at
    ``offset``, or row ``offset`` of ``table``. Raises DataError at ``loc`` for malformed JSON."""
    if table is not None:
        return table.row(offset)
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
