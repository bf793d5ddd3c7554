"""Known third-party console noise, filtered where it is made.

Each entry is a message a disagg user cannot act on (a library's advice for a setup
disagg does not use, a progress notice that breaks the step's progress line); it is
dropped at its source: a ``warnings`` filter for ``warnings.warn``, a
:class:`logging.Filter` on the logger that emits the record. Anything else still
shows. ``import disagg`` installs the filters, so they hold in the driver and in every
Ray worker (actors and Ray Data tasks import disagg to run their code) whatever the
cluster; ``disagg --verbose`` or ``DISAGG_VERBOSE=1`` leaves everything visible (the
variable reaches a local Ray's workers through the environment they inherit).

Logger filters, not levels: Ray reconfigures its loggers (``dictConfig``) when it
starts, resetting child loggers' levels but keeping their filters.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

VERBOSE_ENV = "DISAGG_VERBOSE"

#: (message regex, category): ``warnings.warn`` calls that are noise
WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # megatron-core's advice for its own async overlap, which disagg's TP layers do not rely on
    (r"When using (async grad allreduce|sequence parallelism) it is recommended to set the "
     r"environment variable CUDA_DEVICE_MAX_CONNECTIONS", UserWarning),
    (r".*Transformer Engine and Apex are not installed", UserWarning),
    (r".*imports from `dynamic_context\.py` will be removed", Warning),
    # Ray Data: a small dataset gets fewer tasks than data.num_workers allows
    (r"The maximum number of concurrent tasks for '.*' is set to", UserWarning),
    # Ray Data's own DataContext fields it deprecated itself
    (r"`use_(push_based_shuffle|polars|arrow_tensor_v2)` is deprecated", DeprecationWarning),
)  # fmt: skip

#: logger name -> message regexes of records that are noise
LOG_RECORDS: dict[str, tuple[str, ...]] = {
    # the secure default, announced at every local start
    "ray._private.authentication.authentication_token_setup": (r"Token authentication is enabled",),
    "ray._private.worker": (r"Started a local Ray instance\.$",),
    # disagg draws its own progress line and turns Ray Data's bars off on purpose
    "ray.data._internal.progress": (r"Progress bars disabled",),
    # one line per dataset pass, in the middle of the step's progress line
    "ray.data._internal.execution.streaming_executor": (
        r".*Dataset .* execution (started|finished)",
        r"Starting execution of Dataset",
        r"Execution plan of Dataset",
    ),
}


class _Drop(logging.Filter):
    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot format is not ours to judge
            return True
        return not any(p.match(message) for p in self.patterns)


_installed: list[tuple[logging.Logger, _Drop]] = []


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def install() -> None:
    """Filter the known noise in this process (idempotent); nothing under ``DISAGG_VERBOSE``."""
    if verbose():
        return
    for pattern, category in WARNINGS:  # filterwarnings drops an equal filter before adding it
        warnings.filterwarnings("ignore", message=pattern, category=category)
    if _installed:
        return
    for name, patterns in LOG_RECORDS.items():
        logger = logging.getLogger(name)
        drop = _Drop(patterns)
        logger.addFilter(drop)
        _installed.append((logger, drop))


def set_verbose() -> None:
    """``--verbose``: show everything, here and in the local Ray workers started from here."""
    os.environ[VERBOSE_ENV] = "1"
    for logger, drop in _installed:
        logger.removeFilter(drop)
    _installed.clear()
    for pattern, category in WARNINGS:
        # ahead of install()'s ignores: the first matching filter wins
        warnings.filterwarnings("default", message=pattern, category=category)
