"""What a checkpoint must agree on with the run that resumes from it.

The data position is re-derived from the step number (batches are a pure
function of the datasets, their order seed and the batch size), so resuming
with another batch size, other data files or another seed would silently
train on different samples. The checkpoint records these values; validation
compares them before any actor starts and names every difference.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from disagg.config.schema import Config


def run_fingerprint(cfg: Config) -> dict[str, Any]:
    """The values a resumed run must share with the checkpoint's run."""
    out: dict[str, Any] = {
        "train.seed": cfg.train.seed,
        "model": {m: getattr(cfg.model, m).family for m in cfg.modules()},
    }
    if cfg.data is not None:
        entries = [cfg.data.train] if isinstance(cfg.data.train, str) else cfg.data.train
        out["data.batch_size"] = cfg.data.batch_size
        out["data.shuffle"] = cfg.data.shuffle
        out["data.train"] = [
            {
                "path": Path(e if isinstance(e, str) else e.path).name,
                "weight": 1.0 if isinstance(e, str) else e.weight,
                "sha256": _sha256(Path(e if isinstance(e, str) else e.path)),
            }
            for e in entries
        ]
    return out


def fingerprint_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One sentence per value that differs (empty when the run may resume)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if a == b:
            continue
        if key == "data.train":
            out.append(
                f"data.train: the checkpoint was trained on {_files(a)}, this run reads {_files(b)} "
                "(same names, weights and contents are required)"
            )
        else:
            out.append(f"{key}: the checkpoint has {a!r}, this run has {b!r}")
    return out


def _files(entries: Any) -> str:
    if not entries:
        return "nothing"
    return ", ".join(f"{e['path']} (weight {e['weight']}, sha256 {e['sha256'][:12]})" for e in entries)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return "unreadable"
    return h.hexdigest()
