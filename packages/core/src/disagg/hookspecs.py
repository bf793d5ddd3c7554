"""The hooks a disagg plugin may implement.

Every hook is called with keyword arguments only. Registration hooks receive a
``register`` callback (the pattern of simonw/llm) so one plugin can register any
number of things; they are not ``firstresult``: every plugin is asked. Built-ins
(the ``ddp`` strategy, the object-store and direct transports, the JSONL metrics
logger) are registered through these same hooks by ``disagg.builtin``.

Observer hooks (``disagg_run_started``, ``disagg_log_metrics``,
``disagg_run_finished``) are called through :func:`disagg.plugins.notify`,
which reports an exception raised by one plugin as a warning instead of
stopping the run. Experiment trackers (``logging.trackers``) are objects that
implement them, registered on the run's plugin manager for the run.

Plugins are found through entry points of group ``disagg``; ``DISAGG_PLUGINS=a,b``
(entry-point names) limits which load. Tests get a fresh manager from the
``disagg_plugin_manager`` and ``disagg_registry`` pytest fixtures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pluggy

hookspec = pluggy.HookspecMarker("disagg")


@hookspec
def disagg_register_strategies(register: Callable[[type], None]) -> None:
    """Register parallel strategies.

    Called once when the plugin manager is created, in the driver (strategies
    are resolved to classes there and shipped to the actors by reference).
    ``register(cls)`` takes a :class:`disagg.kit.Strategy` subclass whose
    ``name`` is the value users write in ``parallel.<module>.strategy``.
    Registering a name twice is an error that names both plugins.
    Not ``firstresult``: every plugin is asked; the return value is ignored.
    """


@hookspec
def disagg_register_families(register: Callable[[type], None]) -> None:
    """Register model families.

    Called once when the plugin manager is created. ``register(cls)`` takes a
    :class:`disagg.interfaces.EncoderFamily` or
    :class:`disagg.interfaces.LanguageFamily` subclass. Families are keyed by
    ``(role, name)`` so that one name (``qwen2_5_vl``) may have both a vision
    and a language family, from different plugins. A family's ``check`` is
    called before any actor starts. Not ``firstresult``: every plugin is asked.
    """


@hookspec
def disagg_register_schedules(register: Callable[[type], None]) -> None:
    """Register step schedules (the order of microbatch phases across groups).

    Called once when the plugin manager is created. ``register(cls)`` takes a
    :class:`disagg.interfaces.schedule.Schedule` subclass, selectable by its
    ``name`` in ``train.schedule`` (built-ins: ``sequential``,
    ``encoders_ahead``). Not ``firstresult``: every plugin is asked.
    """


@hookspec
def disagg_register_transports(register: Callable[[type], None]) -> None:
    """Register transports that move activations and gradients between groups.

    Called once when the plugin manager is created. ``register(cls)`` takes a
    :class:`disagg.interfaces.Transport` subclass, selectable by its ``name`` in
    ``parallel.transport``. Not ``firstresult``: every plugin is asked.
    """


@hookspec
def disagg_register_trackers(register: Callable[[type], None]) -> None:
    """Register experiment trackers, selectable in ``logging.trackers``.

    Called once when the plugin manager is created. ``register(cls)`` takes a
    :class:`disagg.interfaces.tracker.Tracker` subclass whose ``name`` is the
    value users write in ``logging.trackers`` (built-ins: ``jsonl``, always
    on, ``tensorboard``, ``mlflow``, ``wandb``). A chosen tracker whose
    ``requires`` modules are missing is refused at validation with its
    ``install`` line. For each chosen name the run makes one instance and
    registers it on the run's plugin manager until the run ends, so it
    receives the observer hooks below. Not ``firstresult``: every plugin is asked.
    """


@hookspec
def disagg_run_started(config: dict[str, Any], run_dir: Path) -> None:
    """Observe the start of a training run.

    Called once in the driver, after the run dir is made and the resolved
    config written to it (``run_dir/config.yaml``), before any actor starts.
    ``config`` is the resolved config as JSON-compatible data (what
    ``config.yaml`` holds: defaults filled in, ``--set`` overrides applied);
    ``run_dir`` is the run's directory (``output_dir``). A tracker opens its
    run here. Not ``firstresult``; must not raise (reported, the run goes on).
    """


@hookspec
def disagg_log_metrics(step: int, metrics: dict[str, Any], scalars: dict[str, float]) -> None:
    """Observe the metrics of one finished optimizer step.

    Called in the driver after every step (and after its evaluation, when
    ``train.eval_every`` or the last step asks for one: the ``eval_*`` keys),
    with ``metrics``, the same dict that is written as one line of
    ``metrics.jsonl``, and ``scalars``, its numbers flattened to tracker names
    (``train/loss``, ``eval/loss``, ``vision/comm_bytes_per_rank``,
    ``llm/collective_bytes_per_rank/all_reduce``; see
    :mod:`disagg.metrics.scalars`). An implementation may take any subset of
    the arguments. Not ``firstresult``: every logger sees every step. Must not
    raise; an exception is reported and the run goes on.
    """


@hookspec
def disagg_run_finished(summary: dict[str, Any]) -> None:
    """Observe the end of a training run.

    Called once in the driver after the last step (or when the run is stopped
    by an error, with ``summary["status"] == "failed"``), with the final
    summary: steps, last loss, mean tokens/s, skipped samples, run dir and,
    when the run evaluated, the last and best ``eval_loss``. A tracker closes
    its run here. Not ``firstresult``; like ``disagg_log_metrics`` it must not raise.
    """
