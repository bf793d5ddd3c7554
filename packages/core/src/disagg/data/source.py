"""``build_data_source``: datasets -> a deterministic stream of global batches of ObjectRefs.

Building a source only indexes the dataset files (where each sample's line
is; nothing parsed or decoded), so it takes the same time and driver memory
for 100 samples as for 100k. Samples are read, validated and preprocessed by
a Ray Data stream (:mod:`disagg.data.stream`) just ahead of the step that
needs them. The order is a pure function of (dataset sizes, weights, seed):
step ``s``'s batch is the next ``batch_size`` good samples after the stream
position where step ``s-1`` ended. That position (plus the skip counters) is
:meth:`RayDataSource.state`, saved with each checkpoint, so a resumed run
starts preprocessing exactly where the interrupted one stopped.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from disagg.config.schema import Config
from disagg.data.errors import DataError
from disagg.data.files import dataset_files, index_file
from disagg.data.formats import VideoError
from disagg.data.index import DatasetIndex
from disagg.data.order import StreamOrder, file_order
from disagg.data.preprocess import modality_modules
from disagg.data.records import NO_VIDEO
from disagg.data.stream import FIRST_CHUNK, SampleStream, StreamConfig
from disagg.data.types import SampleRefs
from disagg.data.video import require_av

log = logging.getLogger("disagg.data")

#: object store bytes Ray Data may hold ahead of training (preprocessed, not yet consumed)
PREFETCH_BYTES = 256 << 20
#: data.group_by_length sorts the samples of this many global batches at a time
GROUP_WINDOW = 8
#: "location: problem" lines kept for the log; counts are exact beyond it
MAX_PROBLEMS = 1000


class RayDataSource:
    """Global batches of :class:`SampleRefs`, deterministic for a seed and resumable at a step."""

    def __init__(
        self,
        indexes: list[DatasetIndex],
        weights: list[float],
        cfg: StreamConfig,
        *,
        batch_size: int,
        seed: int,
        shuffle: bool,
        group_by_length: bool = False,
    ) -> None:
        self.indexes = indexes
        self.sizes = [ix.size for ix in indexes]
        self.uid_base = [int(x) for x in np.cumsum([0, *self.sizes[:-1]])]
        self.weights = weights
        self.cfg = cfg
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.group_by_length = group_by_length
        #: stream position after the last batch handed out (what a checkpoint records); with
        #: group_by_length, the start of the current window and how many of its batches ran
        self.position = 0
        self.window_batches_done = 0
        self._stats = {"samples": sum(self.sizes), "skipped": 0, "dropped_too_long": 0, "truncated": 0}
        self._window_stats = dict(self._stats)  # the counters as of self.position
        #: "location: problem" of skipped or dropped samples seen so far, for the run's log
        self.problems: list[str] = []

    def __len__(self) -> int:
        return sum(self.sizes)

    def stream(self) -> SampleStream:
        order = StreamOrder(self.sizes, self.weights, self.seed, self.shuffle)
        return SampleStream(self.indexes, self.uid_base, order.take, self.cfg)

    def _files(self) -> str:
        return ", ".join(ix.path for ix in self.indexes)

    def _counts(self) -> str:
        return f"{self._stats['skipped']} skipped, {self._stats['dropped_too_long']} too long"

    def samples(self) -> list[SampleRefs]:
        """Every usable sample once, in file order (evaluation; small datasets)."""
        stream = SampleStream(self.indexes, self.uid_base, file_order(self.sizes), self.cfg)
        out = []
        for meta, refs in stream.entries(0, len(self)):
            sample = self._accept(meta, refs)
            if sample is not None:
                out.append(sample)
        if not out:
            raise DataError(
                self._files(), f"no usable samples ({self._counts()}); " + "; ".join(self.problems[:3])
            )
        return out

    def batches(self, start_step: int = 0, state: dict[str, Any] | None = None) -> Iterator[list[SampleRefs]]:
        """Global batches from optimizer step ``start_step`` on.

        ``state`` is :meth:`state` as a checkpoint saved it; without it the
        stream is assumed to have had no skips before ``start_step``."""
        window = GROUP_WINDOW if self.group_by_length else 1
        if state:
            pos, done = int(state["position"]), int(state.get("window_batches_done", 0))
            stats = state.get("stats", {})
        else:
            pos, done, stats = start_step * self.batch_size, 0, {}
            if window > 1:  # steps before start_step filled whole windows only if aligned
                pos, done = (start_step // window) * window * self.batch_size, start_step % window
        self._stats.update(skipped=0, dropped_too_long=0, truncated=0)
        self._stats.update({k: int(v) for k, v in stats.items() if k != "samples"})
        self.position, self.window_batches_done = pos, done
        window_stats = dict(self._stats)
        pending: list[SampleRefs] = []
        bad_run = 0
        for meta, refs in self.stream().entries(pos, first=FIRST_CHUNK * self.batch_size * window):
            sample = self._accept(meta, refs)
            if sample is None:
                bad_run += 1
                # a whole pass without one good sample: the stream would spin forever
                if bad_run > 2 * len(self):
                    raise DataError(
                        self._files(),
                        f"no usable samples ({self._counts()}); " + "; ".join(self.problems[:3]),
                    )
                continue
            bad_run = 0
            pending.append(sample)
            # a skipped sample is replaced by the next good one: every step has batch_size samples
            if len(pending) < window * self.batch_size:
                continue
            end = meta["pos"] + 1
            group = self._group(pending, pos) if window > 1 else [pending]
            for k in range(done, len(group)):
                last = k + 1 == len(group)
                # mid-window, a checkpoint names the window's start and how many of its batches ran
                self.position, self.window_batches_done = (end, 0) if last else (pos, k + 1)
                self._window_stats = dict(self._stats) if last else window_stats
                yield group[k]
            pos, done, pending, window_stats = end, 0, [], dict(self._stats)

    def _group(self, samples: list[SampleRefs], window_start: int) -> list[list[SampleRefs]]:
        """``data.group_by_length``: the window's samples sorted by tokens, cut into batches,
        in an order shuffled by (seed, window start) so that long batches do not come last."""
        ordered = sorted(samples, key=lambda s: (s.num_tokens, s.index))
        b = self.batch_size
        group = [ordered[i : i + b] for i in range(0, len(ordered), b)]
        perm = np.random.default_rng([self.seed, window_start, 104729]).permutation(len(group))
        return [group[i] for i in perm]

    def _accept(self, meta: dict[str, Any], refs: list[Any]) -> SampleRefs | None:
        status = meta["status"]
        if status == "error":
            raise DataError(meta["location"], meta["problem"])
        if status != "ok":
            self._stats["skipped" if status == "skipped" else "dropped_too_long"] += 1
            if len(self.problems) < MAX_PROBLEMS:
                self.problems.append(meta["error"])
            log.warning("%s sample %s", status, meta["error"])
            return None
        if meta.get("truncated"):
            self._stats["truncated"] += 1
        modules = self.cfg.modules
        inputs = {m: r for m, r in zip(modules, refs) if m == "llm" or m in meta["num_media_tokens"]}
        return SampleRefs(
            index=meta["uid"],
            inputs=inputs,
            num_label_tokens=meta["num_label_tokens"],
            num_tokens=meta["num_tokens"],
            source=meta["source"],
            num_media_tokens=meta["num_media_tokens"],
            media_digest=meta.get("media_digest", {}),
        )

    def state(self) -> dict[str, Any]:
        """Where the stream stands after the last batch handed out (saved in checkpoints)."""
        out: dict[str, Any] = {"position": self.position, "stats": dict(self._window_stats)}
        if self.window_batches_done:
            out["window_batches_done"] = self.window_batches_done
        return out

    def stats(self) -> dict[str, int]:
        return dict(self._stats)


def build_data_source(
    cfg: Config,
    families: dict[str, Any],
    *,
    split: str = "train",
    on_preprocess: Any = None,
    refuse_video: bool = True,
) -> RayDataSource:
    """Index the ``split`` datasets of ``cfg.data`` and set up their stream.

    ``families`` are the configured modules' family instances keyed by module
    (``vision``, ``audio``, ``llm``). A missing or unparsable ``.json`` file
    raises :class:`DataError` here; a bad sample raises it (file and line)
    when the stream reaches it, unless ``data.on_error: skip``.
    ``on_preprocess(position)`` is a test hook called in the worker with the
    stream position of every sample it preprocesses. Rows with video that no
    configured family reads (or without PyAV installed) are refused here, before
    any worker starts (``refuse_video=False``: each is reported at its row as the
    stream reaches it, as ``disagg data check`` does).
    """
    data = cfg.data
    files = dataset_files(cfg, split)
    indexes = []
    for f in files:
        ix = index_file(f)
        log.info("%s: %d samples; %s", ix.path, ix.size, ix.how)
        indexes.append(ix)
        if refuse_video:
            _refuse_video(ix, families)
    if sum(ix.size for ix in indexes) == 0:
        names = ", ".join(str(Path(f.path)) for f in files)
        raise DataError(names, "no samples: the dataset files are empty")
    import ray

    if not ray.is_initialized():
        ray.init(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus, include_dashboard=False)
    stream_cfg = StreamConfig(
        families=families,
        modules=[m for m in families if m != "llm"] + ["llm"],
        modalities=set(modality_modules(families)),
        datasets=[ix.spec() for ix in indexes],
        max_tokens=data.max_tokens,
        on_too_long=data.on_too_long,
        on_error=data.on_error,
        num_workers=data.num_workers,
        prefetch_bytes=PREFETCH_BYTES,
        on_preprocess=on_preprocess,
        pixel_limits=pixel_limits(cfg),
        video=video_settings(cfg),
    )
    return RayDataSource(
        indexes,
        [f.weight for f in files],
        stream_cfg,
        batch_size=data.batch_size,
        seed=cfg.train.seed,
        shuffle=data.shuffle if split == "train" else False,
        group_by_length=data.group_by_length and split == "train",
    )


def pixel_limits(cfg: Config) -> dict[str, int] | None:
    """``data.min_pixels``/``max_pixels`` as the image encoder's ``preprocess`` keywords."""
    d = cfg.data
    out = {k: getattr(d, k) for k in ("min_pixels", "max_pixels") if getattr(d, k) is not None}
    return out or None


def video_settings(cfg: Config) -> dict[str, Any]:
    """``data.video_*``: the sampling (``fps``, ``max_frames``) and the per-frame pixel budget
    (``min_pixels``/``max_pixels``, only those set) of every video."""
    d = cfg.data
    out: dict[str, Any] = {"fps": d.video_fps, "max_frames": d.video_max_frames}
    for key in ("min_pixels", "max_pixels"):
        if getattr(d, f"video_{key}") is not None:
            out[key] = getattr(d, f"video_{key}")
    return out


def _refuse_video(ix: DatasetIndex, families: dict[str, Any]) -> None:
    """Video rows the run cannot read (no video encoder, or no PyAV) stop it here, all listed."""
    if "video" in modality_modules(families):
        try:
            require_av()
        except ImportError as exc:
            why = str(exc)
        else:
            return
    else:
        why = NO_VIDEO
    rows = ix.video_rows()
    if rows:
        shown = ", ".join(rows[:5]) + (f" and {len(rows) - 5} more" if len(rows) > 5 else "")
        raise VideoError(
            rows[0], f"{len(rows)} sample(s) with video ({shown}), but {why} (disagg data check lists each)"
        )
