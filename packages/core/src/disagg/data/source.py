"""``build_data_source``: datasets -> validated records -> preprocessed ObjectRefs -> batches.

All samples are preprocessed once, when the source is built, by up to
``num_workers`` parallel Ray tasks; so every bad sample (structure, media, length) is known
before the first step, skip/drop counts are exact, and an epoch boundary or a
resumed run never re-decodes media. The driver keeps only ObjectRefs and a few
integers per sample.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import ray

from disagg.config.schema import Config, DatasetEntry
from disagg.data.errors import DataError
from disagg.data.order import batch_positions
from disagg.data.preprocess import modality_modules
from disagg.data.records import Record, read_dataset
from disagg.data.types import SampleRefs
from disagg.data.workers import run_preprocessing

log = logging.getLogger("disagg.data")


class RayDataSource:
    """Global batches of :class:`SampleRefs`, deterministic for a seed and resumable at a step."""

    def __init__(
        self,
        datasets: list[list[SampleRefs]],
        weights: list[float],
        *,
        batch_size: int,
        seed: int,
        shuffle: bool,
        stats: dict[str, int],
        problems: list[str],
    ) -> None:
        self.datasets = datasets
        self.weights = weights
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._stats = stats
        #: "location: problem" of every skipped or dropped sample, for the run's log
        self.problems = problems

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def samples(self) -> list[SampleRefs]:
        """Every usable sample once, in file order (evaluation)."""
        return [s for d in self.datasets for s in d]

    def batches(self, start_step: int = 0) -> Iterator[list[SampleRefs]]:
        sizes = [len(d) for d in self.datasets]
        for batch in batch_positions(
            sizes, self.weights, self.seed, self.shuffle, self.batch_size, start_step
        ):
            yield [self.datasets[d][i] for d, i in batch]

    def stats(self) -> dict[str, int]:
        return dict(self._stats)


def dataset_entries(cfg: Config, split: str) -> list[DatasetEntry]:
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


def build_data_source(cfg: Config, families: dict[str, Any], *, split: str = "train") -> RayDataSource:
    """Read, validate and preprocess the ``split`` datasets of ``cfg.data``.

    ``families`` are the configured modules' family instances keyed by module
    (``vision``, ``audio``, ``llm``). Raises :class:`DataError` naming the file
    and line/sample of the first bad sample unless ``data.on_error: skip``.
    """
    data = cfg.data
    entries = dataset_entries(cfg, split)
    stats = {"samples": 0, "skipped": 0, "dropped_too_long": 0}
    problems: list[str] = []

    def on_bad(err: DataError) -> None:
        if data.on_error == "error":
            raise err
        stats["skipped"] += 1
        problems.append(str(err))
        log.warning("skipping sample %s", err)

    modalities = set(modality_modules(families))
    records: list[list[Record]] = []
    uid = 0
    for d, entry in enumerate(entries):
        root = entry.media_root if entry.media_root is not None else data.media_root
        recs = read_dataset(entry.path, root, dataset=d, first_uid=uid, modalities=modalities, on_bad=on_bad)
        records.append(recs)
        uid += len(recs)

    if not ray.is_initialized():
        ray.init(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus, include_dashboard=False)
    modules = [m for m in families if m != "llm"] + ["llm"]
    datasets: list[list[SampleRefs]] = [[] for _ in entries]
    done = run_preprocessing(
        (r for recs in records for r in recs),
        families,
        modules,
        num_workers=data.num_workers,
        max_tokens=data.max_tokens,
        on_too_long=data.on_too_long,
        on_error=data.on_error,
    )
    for rec, meta, refs in done:
        if meta["status"] != "ok":
            stats["skipped" if meta["status"] == "skipped" else "dropped_too_long"] += 1
            problems.append(meta["error"])
            log.warning("%s sample %s", meta["status"], meta["error"])
            continue
        inputs = {m: ref for m, ref in zip(modules, refs) if m == "llm" or m in meta["num_media_tokens"]}
        datasets[rec.dataset].append(
            SampleRefs(
                index=rec.uid,
                inputs=inputs,
                num_label_tokens=meta["num_label_tokens"],
                num_tokens=meta["num_tokens"],
                source=rec.source,
                num_media_tokens=meta["num_media_tokens"],
            )
        )
    stats["samples"] = sum(len(d) for d in datasets)
    if stats["samples"] == 0:
        files = ", ".join(str(Path(e.path)) for e in entries)
        raise DataError(
            files,
            f"no usable samples ({stats['skipped']} skipped, {stats['dropped_too_long']} too long); "
            + "; ".join(problems[:3]),
        )
    weights = [e.weight for e in entries]
    return RayDataSource(
        datasets,
        weights,
        batch_size=data.batch_size,
        seed=cfg.train.seed,
        shuffle=data.shuffle if split == "train" else False,
        stats=stats,
        problems=problems,
    )
