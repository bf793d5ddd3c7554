"""Experiment trackers: what ``logging.trackers`` names.

A tracker class is registered through ``disagg_register_trackers``. For each
name in ``logging.trackers`` the run makes one instance and registers it on
the run's plugin manager until the run ends, so a tracker gets the same
observer hooks any plugin gets, and implements them the same way (with
``@hookimpl``): ``disagg_run_started(config, run_dir)`` to open its run,
``disagg_log_metrics(step, metrics, scalars)`` for every step (``scalars``:
the step flattened to tracker names such as ``train/loss``), and
``disagg_run_finished(summary)`` to close. First-party: ``jsonl`` (always on:
``metrics.jsonl``), ``tensorboard``, ``mlflow``, ``wandb``.
"""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class TrackerOptions(BaseModel):
    """A tracker's ``logging.options.<name>`` keys; unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class Tracker:
    """Base class of the trackers ``logging.trackers`` chooses from."""

    #: the value users write in ``logging.trackers``
    name: ClassVar[str] = ""
    #: modules the tracker imports; one that is missing is reported at validation
    requires: ClassVar[tuple[str, ...]] = ()
    #: what installs them, e.g. ``pip install tensorboard``
    install: ClassVar[str] = ""
    #: validates ``logging.options.<name>``
    options_model: ClassVar[type[TrackerOptions]] = TrackerOptions

    def __init__(self, options: TrackerOptions, project: str, run_name: str | None) -> None:
        self.options = options
        #: ``logging.project``: an MLflow experiment, a W&B project
        self.project = project
        #: ``logging.run_name`` (default: the run dir's name)
        self.run_name = run_name

    @classmethod
    def missing(cls) -> list[str]:
        """The required modules that cannot be imported here."""
        return [m for m in cls.requires if importlib.util.find_spec(m) is None]


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1e-4}}`` -> ``{"train.lr": 1e-4}`` (lists as strings),
    for trackers whose parameters are flat (MLflow)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten_config(value, name + "."))
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return out
