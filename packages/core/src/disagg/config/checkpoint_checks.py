"""``checkpoint.resume_from``: a complete checkpoint dir of a run this config can continue."""

from __future__ import annotations

import json
from pathlib import Path

from disagg.config.fingerprint import fingerprint_differences, run_fingerprint
from disagg.config.problems import Problems
from disagg.config.schema import Config


def check_resume(cfg: Config, out: Problems) -> None:
    path = cfg.checkpoint.resume_from
    if not path:
        return
    key = ("checkpoint", "resume_from")
    meta = Path(path) / "meta.json"
    if not meta.is_file():
        what = "does not exist" if not Path(path).exists() else "has no meta.json (not a checkpoint dir)"
        out.add(key, f"{path!r} {what}")
        return
    if not (Path(path) / "manifest.json").is_file():
        out.add(
            key,
            f"{path!r} has no manifest.json: its save did not finish (or it predates checksummed "
            "checkpoints); pick a complete checkpoint (disagg train --resume auto finds the newest)",
        )
        return
    saved = json.loads(meta.read_text()).get("fingerprint")
    if saved is None:
        return  # written before fingerprints existed: nothing to compare
    for difference in fingerprint_differences(saved, run_fingerprint(cfg)):
        out.add(key, f"cannot resume from {path!r}: {difference}")
