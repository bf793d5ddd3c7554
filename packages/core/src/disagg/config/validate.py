"""Checks that need the plugins but no actor: run before anything starts.

Every problem is collected (not just the first) and raised together in one
:class:`ConfigError`, each located by the :class:`SourceMap`. Each section's checks
live in their own file (``*_checks.py``); this one says in which order they run,
which is the order the problems are listed in.
"""

from __future__ import annotations

from disagg.config.checkpoint_checks import check_resume
from disagg.config.data_checks import check_data, check_evaluation, steps_from_epochs
from disagg.config.errors import ConfigError
from disagg.config.logging_checks import check_trackers
from disagg.config.model_checks import check_placeholders, local_model_paths, quiet_llm_family, resolve_module
from disagg.config.parallel_checks import check_devices, check_ray, check_transport, check_unused_groups
from disagg.config.problems import Problems
from disagg.config.resolved import _VALIDATION, ResolvedConfig
from disagg.config.schema import Config
from disagg.config.source import SourceMap
from disagg.config.train_checks import check_precision, check_train
from disagg.plugins import Registry


def validate(cfg: Config, registry: Registry, *, source: SourceMap | None = None) -> ResolvedConfig:
    """Check ``cfg`` against the installed plugins and the file system.

    Returns the resolved config, or raises :class:`ConfigError` with every
    problem found. Relative paths are taken from the current directory.
    """
    out = Problems(source)
    cfg = local_model_paths(cfg, out)  # every later check reads the local dirs
    resolved = ResolvedConfig(config=cfg, transport=cfg.parallel.transport, issued_by=_VALIDATION)
    llm_family = quiet_llm_family(cfg, registry)
    for m in cfg.modules():
        module = resolve_module(cfg, registry, m, llm_family, out)
        if module is not None:
            resolved.modules[m] = module
    check_unused_groups(cfg, out)
    check_placeholders(resolved, out)
    check_ray(cfg, resolved, out)
    check_transport(cfg, registry, out)
    check_devices(cfg, registry, out)
    check_precision(cfg, resolved, out)
    check_train(cfg, registry, resolved, out)
    check_data(cfg, resolved, out)
    check_evaluation(cfg, out)
    check_trackers(cfg, registry, out)
    check_resume(cfg, out)
    if cfg.train.epochs is not None and not out:  # counting reads every data file: only a sound config
        resolved.config = steps_from_epochs(cfg, out)
    if out:
        raise ConfigError(out.found)
    return resolved
