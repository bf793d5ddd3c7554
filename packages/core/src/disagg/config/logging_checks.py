"""``logging``: each tracker installed with what it needs, and options only for trackers named."""

from __future__ import annotations

from pydantic import ValidationError

from disagg.config.errors import allowed, did_you_mean
from disagg.config.problems import Problems
from disagg.config.schema import Config
from disagg.config.translate import problems_from_errors
from disagg.plugins import Registry


def check_trackers(cfg: Config, reg: Registry, out: Problems) -> None:
    log = cfg.logging
    names = sorted(n for n in reg.trackers if n != "jsonl")
    for i, name in enumerate(log.trackers):
        cls = reg.trackers.get(name)
        if cls is None:
            out.add(
                ("logging", "trackers", i),
                f"unknown tracker {name!r}; {allowed(names)}{did_you_mean(name, names)}",
            )
            continue
        missing = cls.missing()
        if missing:
            out.add(
                ("logging", "trackers", i),
                f"tracker {name!r} needs {', '.join(missing)}, which is not installed; run: "
                f"{cls.install} (or pip install 'disagg-core[trackers]' for every first-party tracker)",
            )
    for name, opts in log.options.items():
        cls = reg.trackers.get(name)
        if name not in log.trackers or cls is None:
            out.add(
                ("logging", "options", name),
                f"options for tracker {name!r}, which logging.trackers does not name; "
                f"{allowed(list(log.trackers))}",
            )
            continue
        try:
            cls.options_model.model_validate(opts)
        except ValidationError as exc:
            out.extend(
                problems_from_errors(
                    exc.errors(), cls.options_model, out.source, prefix=("logging", "options", name)
                )
            )
