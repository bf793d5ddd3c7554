"""Preprocessing as a Ray Data stream: stream positions in, per-sample ObjectRefs out.

For a run of stream positions the driver computes which sample each one is
(integers only, :class:`~disagg.data.order.StreamOrder`) and where it lives in
its file (:mod:`disagg.data.index`); a Ray Data ``map_batches`` operator reads,
validates and preprocesses those samples in parallel tasks, ahead of training,
with Ray Data's backpressure bounding how far ahead (``data.prefetch_mb`` of
object store, ``data.num_workers`` tasks). Each output block is split by one
small task into one object per (sample, module): those tasks are submitted by
the driver, so the driver owns the refs (they outlive Ray Data's workers) and
only each sample's few integers and its status ever reach it, never tensors.

A bad sample does not fail the Ray Data job: its status travels with it, and
the driver raises its :class:`DataError` (or counts the skip) when the stream
reaches it, so the error is the same as an eager pass would give, at the
same place in the order.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import ray

from disagg.data.errors import DataError
from disagg.data.formats import VideoError
from disagg.data.index import DatasetIndex, DatasetSpec, read_entry
from disagg.data.preprocess import TooLong, TooLongError, preprocess_record
from disagg.data.records import Record, parse_sample

#: samples per Ray Data block: small, so the first batch is ready after a few samples
BLOCK_ROWS = 4
#: stream positions of the first Ray Data job (times the batch size); each next job doubles,
#: up to CHUNK: a small first job gives a fast first step, big later ones amortize job start-up
FIRST_CHUNK = 2
CHUNK = 1024

_TOKENIZERS: dict[tuple[str, str], Any] = {}


@dataclass
class StreamConfig:
    """What the preprocessing operator needs besides the rows (sent once per job)."""

    families: dict[str, Any]
    modules: list[str]
    modalities: set[str]
    datasets: list[DatasetSpec]
    max_tokens: int | None
    on_too_long: str
    on_error: str
    num_workers: int
    prefetch_bytes: int
    #: ``min_pixels``/``max_pixels`` for the image encoder's preprocess (the set ``data`` keys)
    pixel_limits: dict[str, int] | None = None
    #: ``data.video_*`` for the video encoder (``source.video_settings``)
    video: dict[str, Any] | None = None
    #: False: only each sample's metadata comes out (``disagg data check``), no tensors kept
    keep_inputs: bool = True
    #: test hook: called with the stream position of each entry a worker starts preprocessing
    on_preprocess: Any = None


def _tokenizer(llm: Any) -> Any:
    # Ray reuses worker processes: the tokenizer is loaded once per process, not per sample
    key = (type(llm).__qualname__, str(llm.path))
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = llm.tokenizer()
    return _TOKENIZERS[key]


def preprocess_one(cfg: StreamConfig, pos: int, uid: int, d: int, loc: str, off: int, length: int, text: str):
    """``(meta, inputs)`` of one stream entry; ``inputs`` is None unless ``meta["status"] == "ok"``."""
    if cfg.on_preprocess is not None:
        cfg.on_preprocess(pos)
    ds = cfg.datasets[d]
    try:
        item = read_entry(loc, ds.path, off, length, text, ds.table)
        messages, media = parse_sample(
            item, loc, Path(ds.media_root), cfg.modalities, ds.format, ds.how, ds.columns
        )
        out = preprocess_record(
            Record(uid, d, loc, messages, media),
            cfg.families,
            _tokenizer(cfg.families["llm"]),
            max_tokens=cfg.max_tokens,
            on_too_long=cfg.on_too_long,
            pixel_limits=cfg.pixel_limits,
            video=cfg.video,
        )
    except TooLong as exc:
        return {"status": "dropped", "error": str(exc)}, None
    except DataError as exc:
        # data.on_too_long is its own policy, and video is refused: on_error: skip covers neither
        skip = cfg.on_error == "skip" and not isinstance(exc, (TooLongError, VideoError))
        status = "skipped" if skip else "error"
        return {"status": status, "error": str(exc), "location": exc.location, "problem": exc.problem}, None
    meta = {
        "status": "ok",
        "num_tokens": out.num_tokens,
        "num_label_tokens": out.num_label_tokens,
        "num_media_tokens": out.num_media_tokens,
        "truncated": out.truncated,
        "media_digest": out.media_digest,
    }
    if out.video_frames:
        meta["video_frames"] = out.video_frames
        meta["video_tokens"] = out.video_tokens
    return meta, out.inputs


def preprocess_rows(batch: dict[str, np.ndarray], cfg: StreamConfig) -> dict[str, Any]:
    """The Ray Data operator: a block of stream rows -> their metadata and pickled inputs."""
    import torch

    # several tasks share the cores with the training actors: intra-op threads would only fight
    torch.set_num_threads(1)
    metas, payloads = [], []
    for pos, uid, d, loc, off, length, text in zip(
        batch["pos"], batch["uid"], batch["d"], batch["loc"], batch["off"], batch["len"], batch["text"]
    ):
        meta, inputs = preprocess_one(
            cfg, int(pos), int(uid), int(d), str(loc), int(off), int(length), str(text)
        )
        meta["uid"], meta["source"] = int(uid), str(loc)
        metas.append(json.dumps(meta))
        keep = inputs and cfg.keep_inputs
        payloads.append(pickle.dumps(tuple(inputs.get(m) for m in cfg.modules)) if keep else b"")
    return {"pos": batch["pos"], "meta": metas, "payload": payloads}


def split_block(block: Any, start: int, stop: int, n_modules: int) -> tuple[Any, ...]:
    """One preprocessed block -> ``(metas, None, inputs of each (sample, module)...)``
    (the None keeps it a tuple of refs when ``n_modules`` is 0)."""
    from ray.data.block import BlockAccessor

    cols = BlockAccessor.for_block(block).to_batch_format("numpy")
    metas, flat = [], []
    for i in range(start, stop):
        meta = json.loads(cols["meta"][i])
        meta["pos"] = int(cols["pos"][i])
        metas.append(meta)
        payload = cols["payload"][i]
        if n_modules:
            flat.extend(pickle.loads(payload) if len(payload) else (None,) * n_modules)
    return (metas, None, *flat)


def _pool(size: int) -> dict[str, Any]:
    if hasattr(ray.data, "TaskPoolStrategy"):
        return {"compute": ray.data.TaskPoolStrategy(size=size)}
    return {"concurrency": size}  # Ray < 2.51


class SampleStream:
    """Preprocessed stream entries, in stream order, from any position on."""

    def __init__(self, indexes: list[DatasetIndex], uid_base: list[int], order: Any, cfg: StreamConfig):
        self.indexes, self.uid_base, self.order, self.cfg = indexes, uid_base, order, cfg

    def rows(self, start: int, n: int) -> dict[str, np.ndarray]:
        """The input rows of positions ``start .. start+n-1`` (integers and locations only)."""
        ds, idx = self.order(start, n)
        off = np.zeros(n, dtype=np.int64)
        length = np.zeros(n, dtype=np.int64)
        text = np.full(n, "", dtype=object)
        loc = np.empty(n, dtype=object)
        for d in np.unique(ds):
            m = ds == d
            ix = self.indexes[int(d)]
            sel = idx[m]
            if ix.table is not None:
                off[m] = sel  # the row of the table
                loc[m] = [ix.table.location(int(i)) for i in sel]
            elif ix.offsets is not None:
                off[m], length[m] = ix.offsets[sel], ix.lengths[sel]
                loc[m] = [f"{ix.path}:{line}" for line in ix.lines[sel]]
            else:
                text[m] = [ix.items[i] for i in sel]
                loc[m] = [f"{ix.path}[{i}]" for i in sel]
        uid = np.asarray(self.uid_base, dtype=np.int64)[ds] + idx
        pos = np.arange(start, start + n, dtype=np.int64)
        return {"pos": pos, "uid": uid, "d": ds, "loc": loc, "off": off, "len": length, "text": text}

    def entries(
        self, start: int, stop: int | None = None, first: int = 8
    ) -> Iterator[tuple[dict[str, Any], list[Any]]]:
        """``(meta, refs per module)`` for positions ``start`` .. ``stop`` (endless if None);
        the first Ray Data job covers ``first`` positions, each next one twice as many."""
        pos, chunk = start, max(1, first)
        while stop is None or pos < stop:
            n = chunk if stop is None else min(chunk, stop - pos)
            yield from self._job(self.rows(pos, n))
            pos += n
            chunk = min(2 * chunk, max(CHUNK, first))

    def _job(self, rows: dict[str, np.ndarray]) -> Iterator[tuple[dict[str, Any], list[Any]]]:
        import pyarrow as pa
        from ray.data import ExecutionResources

        n = len(rows["pos"])
        table = pa.table({k: pa.array(list(v) if v.dtype == object else v) for k, v in rows.items()})
        blocks = [table.slice(i, BLOCK_ROWS) for i in range(0, n, BLOCK_ROWS)]
        ds = ray.data.from_arrow(blocks)
        ctx = ds.context
        # the order of the stream is the training order: blocks must come out as they went in
        ctx.execution_options.preserve_order = True
        ctx.execution_options.resource_limits = ExecutionResources(
            object_store_memory=self.cfg.prefetch_bytes
        )
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        ds = ds.map_batches(
            preprocess_rows,
            batch_size=None,  # one block (BLOCK_ROWS samples) per call
            batch_format="numpy",
            fn_kwargs={"cfg": self.cfg},
            # num_cpus=0: the training actors hold the CPUs; the pool size bounds parallelism
            num_cpus=0,
            **_pool(self.cfg.num_workers),
        )
        n_mod = len(self.cfg.modules) if self.cfg.keep_inputs else 0
        split = ray.remote(num_cpus=0)(split_block)
        for bundle in ds.iter_internal_ref_bundles():
            for entry, piece in zip(bundle.blocks, bundle.slices):
                lo, hi = (
                    (0, entry.metadata.num_rows) if piece is None else (piece.start_offset, piece.end_offset)
                )
                if hi <= lo:
                    continue
                refs = split.options(num_returns=2 + (hi - lo) * n_mod).remote(entry.ref, lo, hi, n_mod)
                metas = ray.get(refs[0])
                for k, meta in enumerate(metas):
                    yield meta, list(refs[2 + k * n_mod : 2 + (k + 1) * n_mod])
