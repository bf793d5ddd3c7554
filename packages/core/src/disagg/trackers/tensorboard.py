"""``logging.trackers: [tensorboard]``: scalars as TensorBoard event files
(``run_dir/tensorboard`` unless ``logging.options.tensorboard.log_dir``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from disagg import hookimpl
from disagg.interfaces.tracker import Tracker, TrackerOptions


class TensorBoardOptions(TrackerOptions):
    log_dir: str | None = None
    """Where the event files go; default ``<run dir>/tensorboard``."""


class TensorBoardTracker(Tracker):
    name = "tensorboard"
    requires = ("tensorboard",)
    install = "pip install tensorboard"
    options_model = TensorBoardOptions

    @hookimpl
    def disagg_run_started(self, config: dict[str, Any], run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = self.options.log_dir or str(Path(run_dir) / "tensorboard")  # type: ignore[attr-defined]
        self.writer = SummaryWriter(log_dir=log_dir)
        # TensorBoard's text plugin renders markdown: the resolved config as a YAML block
        self.writer.add_text("config", "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)

    @hookimpl
    def disagg_log_metrics(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a crash must not lose the steps already done

    @hookimpl
    def disagg_run_finished(self, summary: dict[str, Any]) -> None:
        self.writer.close()
