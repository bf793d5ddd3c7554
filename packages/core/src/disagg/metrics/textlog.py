"""``train.log``: the run dir's plain-text log, for ``tail -f`` and a batch system's log.

One line per logged step (step, loss, lr, grad_norm, tokens/s, ETA; an evaluation's loss
on the step that ran it) and the driver's warnings as they happen: Python ``warnings`` and
``logging`` records of level WARNING and above, and disagg's own INFO notes (the peak that
``mfu`` divides by). Appended to, so a resumed run continues the same file. Registered for
every run beside the trackers (:func:`disagg.runtime.tracking.start_trackers`).
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

from disagg import hookimpl

FILE = "train.log"


def _lr(lrs: Any) -> str:
    if not isinstance(lrs, dict):
        return f"{lrs:.3g}"
    values = set(lrs.values())
    if len(values) <= 1:
        return f"{next(iter(values), 0.0):.3g}"
    return ",".join(f"{m}={v:.3g}" for m, v in lrs.items())


def _eta(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _num(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "?"


def step_line(metrics: dict[str, Any], total: int | None, eta_s: float | None) -> str:
    """One step's line: ``step 3/10 loss 2.3456 lr 0.0001 grad_norm 0.812 tokens/s 1234.5 eta 0:00:12``
    (a field the record lacks shows ``?``)."""
    step = f"{metrics.get('step')}/{total}" if total else str(metrics.get("step"))
    parts = [
        f"step {step}",
        f"loss {_num(metrics.get('loss'), '.4f')}",
        f"lr {_lr(metrics['lr']) if 'lr' in metrics else '?'}",
        f"grad_norm {_num(metrics.get('grad_norm'), '.4g')}",
        f"tokens/s {_num(metrics.get('tokens_per_s'), '.1f')}",
        f"eta {_eta(eta_s) if eta_s is not None else '?'}",
    ]
    if "eval_loss" in metrics:
        parts.append(f"eval_loss {_num(metrics['eval_loss'], '.4f')}")
    return " ".join(parts)


class _Handler(logging.Handler):
    """Warnings and errors of any logger, and disagg's own notes, into ``train.log``."""

    def __init__(self, log: TrainLog) -> None:
        super().__init__(logging.INFO)
        self.log = log

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.startswith("disagg")

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.log.write(f"{record.levelname.lower()} {record.name}: {record.getMessage()}")
        except Exception:  # a log line must never stop a run
            self.handleError(record)


class TrainLog:
    """Writes ``<run dir>/train.log`` through the run's hooks."""

    name = "train.log"

    def __init__(self) -> None:
        self._fh: TextIO | None = None
        self.total: int | None = None
        self._t0: float | None = None
        self._first: int | None = None
        self._handler = _Handler(self)
        self._showwarning: Any = None
        self._root_level: int | None = None
        self._last_resort = False

    def write(self, line: str) -> None:
        if self._fh is None:
            return
        self._fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
        self._fh.flush()  # tail -f, and a crash keeps what was logged

    @hookimpl
    def disagg_run_started(self, config: dict[str, Any], run_dir: Path) -> None:
        self.path = Path(run_dir) / FILE
        self._fh = self.path.open("a", encoding="utf-8")
        self.total = (config.get("train") or {}).get("steps")
        self.write(f"run started: {config.get('output_dir', run_dir)}, train.steps {self.total}")
        self._capture()

    @hookimpl
    def disagg_log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        now = time.perf_counter()
        if self._t0 is None:  # the first step of this invocation (a resumed run starts later)
            self._t0, self._first = now - metrics.get("step_time_s", 0.0), step - 1
        done = step - (self._first or 0)
        eta = None
        if self.total and done > 0:
            eta = (now - self._t0) / done * max(self.total - step, 0)
        self.write(step_line(metrics, self.total, eta))

    @hookimpl
    def disagg_run_finished(self, summary: dict[str, Any]) -> None:
        self.write(
            f"run {summary.get('status')}: {summary.get('steps_run', 0)} steps run, "
            f"last step {summary.get('steps', 0)}"
        )
        self.close()

    # -- the driver's warnings ------------------------------------------------------------------
    def _capture(self) -> None:
        root = logging.getLogger()
        # without handlers of its own, logging prints warnings through ``lastResort``; adding ours
        # to the root would silence that: keep the console's output as it was
        if not root.handlers and logging.lastResort is not None:
            root.addHandler(logging.lastResort)
            self._last_resort = True
        root.addHandler(self._handler)
        if logging.getLogger("disagg").getEffectiveLevel() > logging.INFO:
            logging.getLogger("disagg").setLevel(logging.INFO)
            self._root_level = logging.WARNING
        self._showwarning = warnings.showwarning

        def showwarning(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
            self.write(f"warning {category.__name__}: {message} ({filename}:{lineno})")
            self._showwarning(message, category, filename, lineno, *rest)

        warnings.showwarning = showwarning

    def close(self) -> None:
        root = logging.getLogger()
        root.removeHandler(self._handler)
        if self._last_resort:
            root.removeHandler(logging.lastResort)  # type: ignore[arg-type]
            self._last_resort = False
        if self._root_level is not None:
            logging.getLogger("disagg").setLevel(logging.NOTSET)
            self._root_level = None
        if self._showwarning is not None:
            warnings.showwarning = self._showwarning
            self._showwarning = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None


__all__ = ["FILE", "TrainLog", "step_line"]
