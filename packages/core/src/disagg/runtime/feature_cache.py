"""A frozen encoder as a feature service: the driver's index of cached outputs.

An entry holds, for one sample, what each rank of the encoder replica that encoded it sent
the LLM (``(positions, value, total)``, exactly :meth:`ModuleWorker.shards_for`'s tensors),
so a hit hands the LLM the same tensors the encoder would have sent and the encoder is
skipped. The driver holds only ObjectRefs (``host``: the entry lives in the Ray object
store, owned by the driver) or file paths (``disk``: the encoder rank writes, the LLM rank
reads); it never sees a tensor. Entries are evicted least recently used past the size
limit, once a step has finished (no entry in use by a running call goes).

Keys: :mod:`disagg.runtime.feature_key`.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from disagg.runtime.feature_key import RunKey

#: the part of a cached source's entry that the LLM rank receives: a host entry's tensors
#: (resolved by Ray from its ObjectRef) or a disk entry's file path
Part = Any


@dataclass
class _Entry:
    #: one per encoder rank of the replica that produced it: ObjectRefs (host) or paths (disk)
    parts: list[Any]
    nbytes: int = 0
    #: settled (written, sized) at the end of the step that stored it; only a ready entry
    #: hits, so no call reads a file that its writer may not have finished
    ready: bool = False


@dataclass
class CacheCounts:
    """One step's lookups of one module's cache."""

    hits: int = 0
    misses: int = 0
    bytes: int = 0
    entries: int = 0


@dataclass
class FeatureCache:
    """One encoder module's cache (``parallel.<module>.feature_cache``)."""

    module: str
    kind: str  # host | disk
    limit_bytes: int
    family: str
    precision: str
    preprocessing: dict[str, Any]
    directory: Path | None = None
    #: global batches the encoder works through ahead of the LLM (``feature_cache_ahead``)
    ahead: int = 0
    _entries: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)
    #: (keys, each rank's sizes ref) of entries written this step, settled at its end
    _pending: list[tuple[list[str], list[Any]]] = field(default_factory=list)
    _run: RunKey | None = None
    _counts: CacheCounts = field(default_factory=CacheCounts)

    def __post_init__(self) -> None:
        if self.kind == "disk":
            if self.directory is None:
                raise ValueError("a disk feature cache needs a directory")
            self.directory.mkdir(parents=True, exist_ok=True)
            self._scan()

    # -- keys ------------------------------------------------------------------------------------
    @property
    def bound(self) -> bool:
        return self._run is not None

    def bind_weights(self, digests: list[str]) -> None:
        """The group's weights as loaded (each rank's state digest): from here on keys can be made."""
        self._run = RunKey(self.module, self.family, self.precision, self.preprocessing, tuple(digests))

    def key(self, media_digest: str) -> str:
        if self._run is None:
            raise RuntimeError(f"feature cache of {self.module!r}: keys asked before the weights were bound")
        return self._run.key(media_digest)

    # -- lookups ---------------------------------------------------------------------------------
    def lookup(self, key: str) -> list[Part] | None:
        """The entry's parts (and it becomes the most recently used), or None; counted."""
        entry = self._entries.get(key)
        if entry is None or not entry.ready:
            self._counts.misses += 1
            return None
        self._entries.move_to_end(key)
        self._counts.hits += 1
        return list(entry.parts)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    # -- stores ----------------------------------------------------------------------------------
    def store(self, actors: list[Any], mb: int, sample_ids: list[int], keys: list[str]) -> None:
        """Keep what ``actors`` (the ranks of the replica that encoded microbatch ``mb``) send
        the LLM for ``sample_ids`` under ``keys``; submitted after their ``encode`` and before
        their ``drop`` (an actor runs its calls in order)."""
        size_refs = []
        parts: list[list[Any]] = [[] for _ in keys]
        for r, actor in enumerate(actors):
            if self.kind == "host":
                # one object per entry (evicted alone), and the sizes as one more
                refs = actor.cache_out.options(num_returns=len(sample_ids) + 1).remote(mb, sample_ids)
                for k in range(len(keys)):
                    parts[k].append(refs[k])
                size_refs.append(refs[-1])
            else:
                paths = [str(self._file(key, r)) for key in keys]
                size_refs.append(actor.cache_out.remote(mb, sample_ids, paths))
                for k, p in enumerate(paths):
                    parts[k].append(p)
        for key, p in zip(keys, parts):
            self._entries[key] = _Entry(p)
        self._pending.append((list(keys), size_refs))

    def settle(self) -> CacheCounts:
        """At the end of a step (every call of it finished): sizes of the new entries, their
        manifests (disk), eviction past the limit; the step's counts, then fresh ones."""
        for keys, size_refs in self._pending:
            sizes = ray.get(size_refs)
            for k, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is None:
                    continue
                entry.nbytes, entry.ready = sum(s[k] for s in sizes), True
                if self.kind == "disk":
                    self._write_manifest(key, entry)
        self._pending = []
        self._evict()
        counts, self._counts = self._counts, CacheCounts()
        counts.bytes, counts.entries = self.held_bytes, len(self._entries)
        return counts

    @property
    def held_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def _evict(self) -> None:
        while self._entries and self.held_bytes > self.limit_bytes:
            key, entry = self._entries.popitem(last=False)  # dropping the refs frees the objects
            if self.kind == "disk":
                for p in [*entry.parts, str(self._manifest(key))]:
                    Path(p).unlink(missing_ok=True)

    # -- disk ------------------------------------------------------------------------------------
    def _file(self, key: str, rank: int) -> Path:
        assert self.directory is not None
        return self.directory / key[:2] / f"{key}.r{rank}.pt"

    def _manifest(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / key[:2] / f"{key}.json"

    def _write_manifest(self, key: str, entry: _Entry) -> None:
        """An entry exists on disk once its manifest does (written last, atomically)."""
        path = self._manifest(key)
        tmp = path.with_suffix(".json.tmp")
        files = [Path(p).name for p in entry.parts]
        tmp.write_text(json.dumps({"files": files, "bytes": entry.nbytes}))
        os.replace(tmp, path)

    def _scan(self) -> None:
        """Entries a previous run (or attempt) left, oldest use first."""
        assert self.directory is not None
        found = []
        for manifest in self.directory.glob("*/*.json"):
            try:
                meta = json.loads(manifest.read_text())
                files = [manifest.parent / f for f in meta["files"]]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a torn manifest is no entry
            if all(f.is_file() for f in files):
                found.append((manifest.stat().st_mtime, manifest.stem, files, int(meta["bytes"])))
        for _, key, files, nbytes in sorted(found):
            self._entries[key] = _Entry([str(f) for f in files], nbytes, ready=True)


def write_part(path: str, part: tuple[torch.Tensor, torch.Tensor, int]) -> int:
    """Write one rank's entry (atomically: a reader never sees half a file); its bytes."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
    torch.save(part, tmp)
    os.replace(tmp, target)
    return target.stat().st_size


def read_part(part: Part) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A cached source's ``(positions, value, total)`` on the LLM rank: a host entry as Ray
    resolved it, a disk entry read from its file."""
    if isinstance(part, str):
        positions, value, total = torch.load(part, map_location="cpu", weights_only=True)
        return positions, value, int(total)
    return part


def part_bytes(part: tuple[torch.Tensor, torch.Tensor, int]) -> int:
    positions, value, _ = part
    return positions.numel() * positions.element_size() + value.numel() * value.element_size()


def feature_caches(cfg: Any, precision: str) -> dict[str, FeatureCache]:
    """The run's caches (``parallel.<m>.feature_cache``), by module; validation has checked
    each (a frozen encoder, a writable dir, room for a batch)."""
    from disagg.config.feature_cache_checks import cache_dir
    from disagg.runtime.feature_key import processor_digest

    out = {}
    for m in cfg.modules():
        g = getattr(cfg.parallel, m)
        if g.feature_cache == "none":
            continue
        spec = getattr(cfg.model, m)
        preprocessing = {
            "min_pixels": cfg.data.min_pixels,
            "max_pixels": cfg.data.max_pixels,
            "processor": processor_digest(spec.path),
            "options": spec.options,
        }
        out[m] = FeatureCache(
            m,
            g.feature_cache,
            int(g.feature_cache_gb * 1e9),
            spec.family,
            precision,
            preprocessing,
            cache_dir(cfg, m) if g.feature_cache == "disk" else None,
            g.feature_cache_ahead,
        )
    return out
