"""The run's trackers: ``jsonl`` (always) and those ``logging.trackers`` names,
one instance each, registered on the run's plugin manager until the run ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from disagg.config.schema import Config
from disagg.plugins import Registry, notify


def start_trackers(cfg: Config, run_dir: Path, registry: Registry) -> list[Any]:
    """Make and register the trackers (``jsonl`` first), then tell every
    plugin the run started (``disagg_run_started``)."""
    pm = registry.pm
    assert pm is not None
    log = cfg.logging
    names = ["jsonl", *(n for n in log.trackers if n != "jsonl")]
    trackers = []
    for name in names:
        cls = registry.trackers[name]  # validation refused unknown names
        options = cls.options_model.model_validate(log.options.get(name, {}))
        tracker = cls(options, log.project, log.run_name)
        pm.register(tracker, name=f"disagg.tracker.{name}:{id(tracker)}")
        trackers.append(tracker)
    trackers[0].open(run_dir)  # metrics.jsonl exists whatever another tracker does
    from disagg.metrics.textlog import TrainLog

    text = TrainLog()  # train.log: one line per step and the driver's warnings, every run
    pm.register(text, name=f"disagg.train_log:{id(text)}")
    trackers.append(text)
    notify("disagg_run_started", pm=pm, config=cfg.model_dump(mode="json"), run_dir=Path(run_dir))
    return trackers


def stop_trackers(trackers: list[Any], pm: Any) -> None:
    """Unregister the run's trackers (after ``disagg_run_finished``)."""
    for tracker in trackers:
        if pm.is_registered(tracker):
            pm.unregister(tracker)
