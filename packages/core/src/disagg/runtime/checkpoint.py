"""Checkpoints: complete, atomic, layout-free.

``checkpoints/step-N/`` holds, per module, its parameters and AdamW state
(sharded, the default: each rank's own pieces, see below; ``checkpoint.format:
full``: merged, unpartitioned), the scheduler and every
rank's random streams (written by the actors: :mod:`disagg.runtime.actor.state`),
then ``data.json`` (the data stream's position), ``meta.json`` (step, resolved
config, run fingerprint) and last ``manifest.json`` (layout, package versions,
sha256 and size of every file). Everything is written under ``step-N.tmp/`` and
renamed only once every file is on disk and checksummed, so a crash mid-save
leaves the previous checkpoint as it was; a dir without a manifest is not a
checkpoint. Any layout resumes from any other's (the full form is sliced by
each strategy); ``disagg export`` reads it without starting actors.

With ``checkpoint.format: sharded`` (the default) nothing is merged: each rank writes only its
own pieces of parameters and optimizer state through ``torch.distributed.checkpoint``
(``<module>/dcp/``, :mod:`disagg.runtime.actor.state`), under the same atomic
rename, checksums and manifest; a resume into any layout reads only what its
ranks hold (DCP reshards).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

from disagg.config.fingerprint import run_fingerprint
from disagg.config.schema import Config
from disagg.runtime.actor.state import file_digest

FORMAT = "disagg-full/1"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
#: distributions whose versions a checkpoint records
_DISTRIBUTIONS = (
    "disagg-core",
    "disagg-vision-sp",
    "disagg-llm-tp",
    "disagg-zero",
    "disagg-audio",
    "torch",
    "transformers",
    "deepspeed",
    "megatron-core",
    "safetensors",
)


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupted or not one at all."""


def save_checkpoint(
    orch: Any,
    cfg: Config,
    run_dir: Path,
    step: int,
    data_state: dict[str, Any] | None = None,
    keep: Path | None = None,
) -> Path:
    """Write ``checkpoints/step-{step}`` atomically; keep the newest
    ``checkpoint.keep_last`` and ``keep`` (the best one, ``checkpoint.keep_best``).
    Returns the checkpoint dir."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step-{step}", root / f"step-{step}.tmp"
    if tmp.exists():  # a save that died before its rename
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    files = orch.save_full(str(tmp), sharded=cfg.checkpoint.format == "sharded")
    meta = {"step": step, "config": cfg.model_dump(mode="json"), "fingerprint": run_fingerprint(cfg)}
    _write(tmp / "meta.json", json.dumps(meta, indent=2))
    files["meta.json"] = file_digest(tmp / "meta.json")
    if data_state is not None:
        # where the data stream stands after this step's batch: a resume does not replay it
        _write(tmp / "data.json", json.dumps(data_state, indent=2))
        files["data.json"] = file_digest(tmp / "data.json")
    manifest = {
        "format": FORMAT,
        "step": step,
        "layout": layout_of(cfg),
        "versions": _versions(),
        "files": dict(sorted(files.items())),
    }
    _write(tmp / MANIFEST, json.dumps(manifest, indent=2))
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again (a resumed run): replace it whole
        old = root / f"step-{step}.old"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync_dir(root)
    if cfg.checkpoint.keep_last:
        for path in complete_checkpoints(run_dir)[: -cfg.checkpoint.keep_last]:
            if keep is None or path.resolve() != Path(keep).resolve():
                shutil.rmtree(path)
    return final


def layout_of(cfg: Config) -> dict[str, dict[str, Any]]:
    return {
        m: {
            "strategy": getattr(cfg.parallel, m).strategy,
            "degree": getattr(cfg.parallel, m).degree,
            "replicas": getattr(cfg.parallel, m).replicas,
        }
        for m in cfg.modules()
    }


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's checkpoints whose save finished (a manifest), oldest first."""
    root = Path(run_dir) / "checkpoints"
    found = []
    for p in root.iterdir() if root.is_dir() else []:
        m = _STEP_DIR.match(p.name)
        if m and (p / MANIFEST).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """The manifest, after checking every file it lists against its size and
    sha256; a missing, truncated or altered file is refused."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        why = "does not exist" if not path.exists() else f"has no {MANIFEST}: its save did not finish"
        raise CheckpointError(f"checkpoint {path} {why}; resume from a complete one (--resume auto finds it)")
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path / MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    for rel, want in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: {rel} is missing")
        got = file_digest(f)
        if got != want:
            raise CheckpointError(
                f"checkpoint {path}: {rel} fails its checksum ({got['bytes']} bytes, sha256 "
                f"{got['sha256'][:16]}…; the manifest says {want['bytes']} bytes, sha256 "
                f"{want['sha256'][:16]}…): the file is truncated or corrupted; "
                "resume from an earlier checkpoint"
            )
    return manifest


def load_checkpoint(orch: Any, cfg: Config, path: str | Path) -> tuple[int, dict[str, Any] | None]:
    """Verify ``path`` and load it into every group (any layout); returns the
    step it was saved at and the data position (``None`` if not saved).
    Random streams continue where the layout of a module is unchanged; a
    resharded module starts fresh streams (its ranks are not the saved ones)."""
    manifest = verify_checkpoint(path)
    now = layout_of(cfg)
    saved = manifest["layout"]
    missing = [m for m in now if m not in saved]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no module {missing[0]!r} (it holds {sorted(saved)})")
    orch.load_full(str(path), {m: saved[m] == now[m] for m in now})
    data = Path(path) / "data.json"
    return int(manifest["step"]), json.loads(data.read_text()) if data.is_file() else None


def _versions() -> dict[str, str]:
    out = {}
    for dist in _DISTRIBUTIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
