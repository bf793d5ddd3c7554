"""``metrics.jsonl``: one JSON object per optimizer step, written by the
``jsonl`` tracker, registered through ``disagg_register_trackers`` and put on
the run's plugin manager like any other tracker. It is always on: the run's
summary, ``disagg plot`` and resumed runs read the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disagg import hookimpl
from disagg.interfaces.tracker import Tracker, TrackerOptions

FILE = "metrics.jsonl"


class JsonlMetricsLogger(Tracker):
    name = "jsonl"

    def __init__(
        self, options: TrackerOptions | None = None, project: str = "disagg", run_name: str | None = None
    ) -> None:
        super().__init__(options or TrackerOptions(), project, run_name)
        self._fh: Any = None

    def open(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")

    @hookimpl
    def disagg_run_started(self, config: dict[str, Any], run_dir: Path) -> None:
        if self._fh is None:
            self.open(run_dir)

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
        if self._fh is not None:
            self._fh.close()
