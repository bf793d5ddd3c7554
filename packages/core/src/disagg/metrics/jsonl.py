"""``metrics.jsonl``: one JSON object per optimizer step, written by a plugin
object registered on the run's plugin manager like any third-party logger."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disagg import hookimpl


class JsonlMetricsLogger:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")

    @hookimpl
    def disagg_log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        self._fh.write(json.dumps(metrics, sort_keys=True) + "\n")
        self._fh.flush()  # a crash must not lose the steps already done

    def log_event(self, event: dict[str, Any]) -> None:
        """A line that is not a step (``event`` names what happened, e.g. a restart)."""
        self._fh.write(json.dumps(event, sort_keys=True) + "\n")
        self._fh.flush()

    @hookimpl
    def disagg_run_finished(self, summary: dict[str, Any]) -> None:
        self._fh.close()
