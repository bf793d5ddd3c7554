"""``logging.trackers: [wandb]``: a Weights & Biases run, offline by default.

Offline runs are written under ``<run dir>/wandb/`` and uploaded later with
``wandb sync`` (set ``logging.options.wandb.mode: online`` to stream instead).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from disagg import hookimpl
from disagg.interfaces.tracker import Tracker, TrackerOptions


class WandbOptions(TrackerOptions):
    mode: Literal["offline", "online", "disabled"] = "offline"
    """``offline`` writes the run locally (``wandb sync`` uploads it), ``online`` streams it."""
    entity: str | None = None
    """W&B team or user; default your default entity."""


class WandbTracker(Tracker):
    name = "wandb"
    requires = ("wandb",)
    install = "pip install wandb"
    options_model = WandbOptions

    @hookimpl
    def disagg_run_started(self, config: dict[str, Any], run_dir: Path) -> None:
        import wandb

        run_dir = Path(run_dir).resolve()
        self.run = wandb.init(
            project=self.project,
            entity=self.options.entity,  # type: ignore[attr-defined]
            name=self.run_name or run_dir.name,
            dir=str(run_dir),
            mode=self.options.mode,  # type: ignore[attr-defined]
            config=config,
            # the driver's stdout is the training progress bar, not W&B's to capture
            settings=wandb.Settings(console="off"),
        )

    @hookimpl
    def disagg_log_metrics(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    @hookimpl
    def disagg_run_finished(self, summary: dict[str, Any]) -> None:
        self.run.finish(exit_code=0 if summary.get("status") == "ok" else 1)
