"""Hugging Face datasets on disk, read row by row: parquet files and ``save_to_disk`` dirs (pyarrow),
and dirs of JSONL files (each indexed like a JSONL dataset).

Why pyarrow and not ``datasets`` or ``ray.data.read_parquet``: the stream
needs random access by row (a deterministic shuffle per seed, and a resumed
run that starts at its exact position without reading what came before),
which ``datasets``' streaming mode cannot give and ``read_parquet`` (a scan in
file order) does not either; ``datasets``' own random access (``load_dataset``)
first copies the whole dataset into its cache. pyarrow is what both of them
read with and comes with Ray Data: the driver reads only the files' metadata
(row counts), and each data worker reads the row group (parquet) or the
memory-mapped record batches (``save_to_disk``'s Arrow files) that hold the
rows it preprocesses, so neither the driver nor a worker ever holds the table.

A row is the dict ``datasets`` would give (``Image``/``Audio`` features stay
``{"bytes", "path"}`` structs: :mod:`disagg.data.records` decodes the bytes).
Random access costs a parquet row group per sample read from a new group:
write parquet with small row groups for shuffled training, or use
``save_to_disk``, whose memory-mapped Arrow files make a row free to reach.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from disagg.data.errors import DataError
from disagg.data.formats import VIDEO_KEYS

#: per worker process: the last few parquet row groups / Arrow tables read
_CACHE: dict[tuple[str, int], Any] = {}
_CACHE_SIZE = 4
#: per process: the line index of each JSONL file of a dir (16 bytes a row)
_JSONL: dict[str, Any] = {}


@dataclass(frozen=True)
class Table:
    """One dataset made of parquet files or ``save_to_disk`` Arrow files (picklable, small)."""

    kind: str  # "parquet", "arrow" or "jsonl"
    files: tuple[str, ...]
    rows: tuple[int, ...]

    @property
    def size(self) -> int:
        return sum(self.rows)

    def _where(self, i: int) -> tuple[int, int]:
        bounds = np.cumsum([0, *self.rows])
        f = int(np.searchsorted(bounds, i, side="right")) - 1
        return f, i - int(bounds[f])

    def location(self, i: int) -> str:
        f, j = self._where(i)
        if self.kind == "jsonl":
            return _jsonl_index(self.files[f]).location(j)
        return f"{self.files[f]}[{j}]"

    def row(self, i: int) -> dict[str, Any]:
        f, j = self._where(i)
        if self.kind == "jsonl":
            return _jsonl_index(self.files[f]).read(j)
        if self.kind == "arrow":
            return _arrow_table(self.files[f]).slice(j, 1).to_pylist()[0]
        group, k = _row_group(self.files[f], j)
        return _parquet_group(self.files[f], group).slice(k, 1).to_pylist()[0]

    def video_rows(self) -> list[str]:
        """Locations of the rows whose ``video``/``videos`` column holds something; only
        those columns are read."""
        out = []
        for path in self.files:
            if self.kind == "jsonl":
                out += _jsonl_index(path).video_rows()
                continue
            cols = [c for c in _schema(self.kind, path).names if c in VIDEO_KEYS]
            if not cols:
                continue
            table = _arrow_table(path) if self.kind == "arrow" else _parquet_columns(path, cols)
            held = {j for c in cols for j, v in enumerate(table.column(c).to_pylist()) if v}
            out += [f"{path}[{j}]" for j in sorted(held)]
        return out


def open_table(path: Path) -> Table:
    """The :class:`Table` of a ``.parquet`` file or a Hugging Face dataset dir."""
    import pyarrow.parquet as pq

    if path.is_file():
        files = [path]
        kind = "parquet"
    elif (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(
            str(path),
            f"a DatasetDict dir holds several splits; name one: {', '.join(str(path / s) for s in splits)}",
        )
    elif (path / "state.json").is_file():
        state = json.loads((path / "state.json").read_text())
        files = [path / f["filename"] for f in state.get("_data_files", [])]
        kind = "arrow"
    elif path.is_dir():
        files = sorted(path.rglob("*.parquet"))
        kind = "parquet"
        if not files:
            files, kind = sorted(path.rglob("*.jsonl")), "jsonl"
        if not files:
            raise DataError(
                str(path),
                "not a Hugging Face dataset dir: no state.json (save_to_disk), no .parquet and no "
                ".jsonl files",
            )
    else:
        raise DataError(str(path), "dataset file not found")
    rows = []
    for f in files:
        if kind == "jsonl":
            rows.append(_jsonl_index(str(f)).size)
            continue
        try:
            n = pq.ParquetFile(f).metadata.num_rows if kind == "parquet" else _arrow_table(str(f)).num_rows
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise DataError(str(f), f"cannot read {kind} file: {type(exc).__name__}: {exc}") from None
        rows.append(int(n))
    return Table(kind, tuple(str(f) for f in files), tuple(rows))


def _jsonl_index(path: str) -> Any:
    from disagg.data.index import index_jsonl

    if path not in _JSONL:
        _JSONL[path] = index_jsonl(path)
    return _JSONL[path]


def _cached(key: tuple[str, int], load: Any) -> Any:
    if key not in _CACHE:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = load()
    return _CACHE[key]


def _arrow_table(path: str) -> Any:
    import pyarrow as pa

    # memory-mapped: reading all batches touches only their metadata until a row is sliced
    return _cached((path, -1), lambda: pa.ipc.open_stream(pa.memory_map(path)).read_all())


def _row_group(path: str, j: int) -> tuple[int, int]:
    import pyarrow.parquet as pq

    sizes = _cached((path, -2), lambda: np.cumsum([0, *(g.num_rows for g in _groups(pq.ParquetFile(path)))]))
    g = int(np.searchsorted(sizes, j, side="right")) - 1
    return g, j - int(sizes[g])


def _groups(pf: Any) -> list[Any]:
    return [pf.metadata.row_group(k) for k in range(pf.metadata.num_row_groups)]


def _parquet_group(path: str, group: int) -> Any:
    import pyarrow.parquet as pq

    return _cached((path, group), lambda: pq.ParquetFile(path).read_row_group(group))


def _parquet_columns(path: str, cols: list[str]) -> Any:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=cols)


def _schema(kind: str, path: str) -> Any:
    import pyarrow.parquet as pq

    return _arrow_table(path).schema if kind == "arrow" else pq.read_schema(path)
