"""A config's datasets, resolved to files: ``data.train``/``data.eval`` entries as written,
and each as the file it reads and how its rows read (names under ``data.dataset_dir`` looked up
in its ``dataset_info.json``). No Ray here: config validation uses it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from disagg.config.schema import Config, DatasetEntry
from disagg.data.dataset_info import Columns, read_info, resolve
from disagg.data.index import DatasetIndex, index_dataset


def dataset_entries(cfg: Config, split: str) -> list[DatasetEntry]:
    """The ``split``'s entries as written: paths, or dataset names under ``data.dataset_dir``."""
    if cfg.data is None:
        raise ValueError("data: missing; set data.train to a JSON/JSONL dataset")
    if split == "train":
        spec = cfg.data.train
    elif split == "eval":
        if cfg.data.eval is None:
            raise ValueError("data.eval: not set; cannot build the 'eval' split")
        spec = cfg.data.eval
    else:
        raise ValueError(f"split {split!r} unknown; allowed: train, eval")
    return [DatasetEntry(path=spec)] if isinstance(spec, str) else list(spec)


@dataclass
class DatasetFile:
    """One dataset of a split, resolved: its file, media root and how its rows read."""

    path: str
    media_root: str
    format: str
    weight: float = 1.0
    #: a LLaMA-Factory dataset_info.json entry's columns and tags (``data.dataset_dir``)
    columns: Columns | None = None


def dataset_files(cfg: Config, split: str) -> list[DatasetFile]:
    """The ``split``'s datasets; names under ``data.dataset_dir`` are looked up in its
    ``dataset_info.json`` (raises DataError naming the entry's key it cannot honour)."""
    data = cfg.data
    out = []
    for e in dataset_entries(cfg, split):
        root = e.media_root if e.media_root is not None else data.media_root
        if data.dataset_dir is None or is_plain_file(data.dataset_dir, e.path):
            out.append(DatasetFile(e.path, root, e.format or data.format, e.weight))
            continue
        path, columns = resolve(data.dataset_dir, e.path)
        if e.media_root is None and "media_root" not in data.model_fields_set:
            root = data.dataset_dir  # LLaMA-Factory's media_dir defaults to its dataset_dir
        out.append(DatasetFile(path, root, columns.formatting, e.weight, columns))
    return out


def is_plain_file(dataset_dir: str, entry: str) -> bool:
    """Beside ``dataset_info.json``'s names, an entry may be a dataset file of its own (mixing a
    LLaMA-Factory dataset with others): a name of the list wins over a file of that name."""
    return entry not in read_info(dataset_dir) and Path(entry).exists()


def index_file(f: DatasetFile) -> DatasetIndex:
    return index_dataset(f.path, f.media_root, f.format, f.columns)
