"""Checks that need the plugins but no actor: run before anything starts.

Every problem is collected (not just the first) and raised together in one
:class:`ConfigError`, each located by the :class:`SourceMap`. Each section's checks
live in their own file (``*_checks.py``); this one says in which order they run,
which is the order the problems are listed in.

A config is read in two stages, the schema's (types, ranges, unknown keys: no plugin
needed) and the checks here (plugins, files, meshes). :func:`load_checked` makes them one
pass: when the schema refuses some keys, the checks still run on the config without
them (those keys at their defaults), so a typo in ``train.lr`` and an unknown strategy
are reported together instead of one run at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from disagg.config.checkpoint_checks import check_resume
from disagg.config.data_checks import check_data, check_evaluation, steps_from_epochs
from disagg.config.errors import ConfigError
from disagg.config.feature_cache_checks import check_feature_cache
from disagg.config.load import apply_override, load_config_and_source, parse_override, read_yaml
from disagg.config.logging_checks import check_trackers
from disagg.config.model_checks import check_placeholders, local_model_paths, quiet_llm_family, resolve_module
from disagg.config.parallel_checks import check_devices, check_ray, check_transport, check_unused_groups
from disagg.config.problems import Problems
from disagg.config.resolved import _VALIDATION, ResolvedConfig
from disagg.config.schema import Config
from disagg.config.source import SourceMap, dotted
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
    check_feature_cache(cfg, registry, out)
    check_data(cfg, resolved, out)
    check_evaluation(cfg, out)
    check_trackers(cfg, registry, out)
    check_resume(cfg, out)
    if cfg.train.epochs is not None and not out:  # counting reads every data file: only a sound config
        resolved.config = steps_from_epochs(cfg, out)
    if out:
        raise ConfigError(out.found)
    return resolved


#: rounds of dropping refused keys before the checks give up on a partial config
_PARTIAL_ROUNDS = 4


def load_checked(path: str | Path, overrides: Sequence[str], registry: Registry) -> tuple[Config, SourceMap]:
    """:func:`~disagg.config.load.load_config_and_source`, raising the schema's problems and
    :func:`validate`'s together. A config the schema accepts comes back unvalidated (the
    caller validates it once it is final, e.g. after ``--resume`` or ``parallel: auto``)."""
    try:
        return load_config_and_source(path, overrides)
    except ConfigError as exc:
        schema = exc
    partial = _without_refused(path, overrides)
    if partial is None:
        raise schema
    cfg, source, refused = partial
    try:
        validate(cfg, registry, source=source)
    except ConfigError as more:
        # a check of a key the schema refused would judge its default, not what was written
        extra = [p for p in more.problems if not any(_under(p.key, k) for k in refused)]
        raise ConfigError([*schema.problems, *extra]) from None
    except Exception:  # the partial config is only a means to more problems; the schema's stand
        pass
    raise schema


def _without_refused(
    path: str | Path, overrides: Sequence[str]
) -> tuple[Config, SourceMap, list[str]] | None:
    """The config with every key the schema refuses removed (back to its default), the
    keys removed; None when that does not give a config (a required key is refused)."""
    try:
        data, source = read_yaml(path)
        for item in overrides:
            key, value = parse_override(item)
            apply_override(data, key, value)
            source.overrides[key] = item
    except ConfigError:
        return None
    refused: list[str] = []
    for _ in range(_PARTIAL_ROUNDS):
        try:
            return Config.model_validate(data), source, refused
        except ValidationError as exc:
            locs = sorted({_data_loc(data, tuple(err["loc"])) for err in exc.errors()}, key=len)
            for loc in locs:
                if any(loc[: len(r)] == r for r in locs if len(r) < len(loc)):
                    continue  # its section goes as a whole
                if not loc or not _drop(data, loc):
                    return None
                refused.append(dotted(loc))
    return None


def _data_loc(data: Any, loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """The part of pydantic's ``loc`` that exists in ``data`` (its union-member tags dropped)."""
    out: list[Any] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            out.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            out.append(part)
            node = node[part]
    return tuple(out)


def _drop(data: dict[str, Any], loc: tuple[Any, ...]) -> bool:
    node: Any = data
    for part in loc[:-1]:
        node = node[part]
    if isinstance(node, dict):
        del node[loc[-1]]
        return True
    return False


def _under(key: str, refused: str) -> bool:
    return key == refused or key.startswith(refused + ".")
