"""What the driver does when a rank's process or node dies mid-run
(``fault_tolerance.max_restarts``): record it, then resume new groups from
the newest complete checkpoint, or stop once the restarts are spent."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from disagg.config.schema import Config
from disagg.runtime.checkpoint import latest_checkpoint
from disagg.runtime.failures import ActorDied

log = logging.getLogger("disagg.recovery")


class RestartsExhausted(RuntimeError):
    """More ranks died than ``fault_tolerance.max_restarts`` allows."""


def recover(exc: ActorDied, failures: int, cfg: Config, run_dir: Path, logger: Any) -> Path | None:
    """The checkpoint to resume from after failure number ``failures``
    (``None``: none was completed, start over); raises
    :class:`RestartsExhausted` naming the dead rank when none is left.
    The event goes to ``run_dir/events.jsonl`` and ``metrics.jsonl``."""
    limit = cfg.fault_tolerance.max_restarts
    ckpt = latest_checkpoint(run_dir) if failures <= limit else None
    event = {
        "event": "actor_died",
        "failure": failures,
        "max_restarts": limit,
        "rank": exc.who,
        "error": str(exc),
        "action": ("resume from " + (str(ckpt) if ckpt else "the start")) if failures <= limit else "stop",
        "time": time.time(),
    }
    with open(Path(run_dir) / "events.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(event) + "\n")
    logger.log_event(event)
    if failures > limit:
        raise RestartsExhausted(
            f"{exc}; the run stops after {failures} failure(s): fault_tolerance.max_restarts is {limit}"
        ) from exc
    log.warning("%s; restart %d of %d: %s", exc, failures, limit, event["action"])
    return ckpt
