"""YAML file + ``--set`` overrides -> a validated :class:`Config`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from disagg.config.errors import ConfigError, Problem
from disagg.config.schema import Config
from disagg.config.source import SourceMap, dotted
from disagg.config.translate import problems_from_validation


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Parse and validate ``path`` with ``--set dotted.key=value`` overrides applied.

    Raises :class:`ConfigError` listing every problem, each with its file and
    line (or the ``--set`` that caused it), the key, the bad value and what is
    allowed. Checks that need the plugins (strategy names...) are
    :func:`disagg.config.validate.validate`'s.
    """
    return load_config_and_source(path, overrides)[0]


def load_config_and_source(path: str | Path, overrides: Sequence[str] = ()) -> tuple[Config, SourceMap]:
    """Like :func:`load_config`, also returning where each value came from."""
    data, source = read_yaml(path)
    problems: list[Problem] = []
    for item in overrides:
        try:
            key, value = parse_override(item)
            apply_override(data, key, value, where=f"--set {item}")
            source.overrides[key] = item
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise ConfigError(problems)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(problems_from_validation(exc, Config, source)) from None
    return cfg, source


def read_yaml(path: str | Path) -> tuple[dict[str, Any], SourceMap]:
    file = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(Problem("", f"config file {file!r} does not exist")) from None
    except OSError as exc:
        raise ConfigError(Problem("", f"cannot read config file {file!r}: {exc}")) from None
    try:
        source, dupes = SourceMap.from_yaml(text, file)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{file}:{mark.line + 1}" if mark is not None else file
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(Problem("", f"invalid YAML: {problem}", where)) from None
    if dupes:
        raise ConfigError(
            [Problem(dotted(p), "key appears twice; keep one", f"{file}:{line}") for p, line in dupes]
        )
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            Problem("", f"the file must hold a mapping of sections, got {type(data).__name__}", file)
        )
    return data, source


def parse_override(item: str) -> tuple[tuple[str | int, ...], Any]:
    """``"train.lr=1e-3"`` -> ``(("train", "lr"), 0.001)``; the value is read as YAML."""
    where = f"--set {item}"
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise ConfigError(Problem("", "expected --set dotted.key=value, e.g. --set train.lr=1e-4", where))
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(Problem(key, f"value {raw!r} is not valid YAML: {exc}", where)) from None
    path = tuple(int(p) if p.isdigit() else p.strip() for p in parts)
    return path, value


def apply_override(
    data: dict[str, Any], path: tuple[str | int, ...], value: Any, where: str | None = None
) -> None:
    """Write ``value`` at ``path``, creating sections on the way."""
    where = where or f"--set {dotted(path)}"
    node: Any = data
    for i, part in enumerate(path[:-1]):
        if isinstance(node, list) and isinstance(part, int):
            if part >= len(node):
                raise ConfigError(
                    Problem(dotted(path), f"index {part} is out of range ({len(node)} items)", where)
                )
            node = node[part]
            continue
        if not isinstance(node, dict):
            raise ConfigError(Problem(dotted(path), f"{dotted(path[:i])} is a value, not a section", where))
        node = node.setdefault(part, {})
        if node is None:  # "vision:" with nothing under it
            node = data_set(data, path[: i + 1], {})
    last = path[-1]
    if isinstance(node, list) and isinstance(last, int) and last < len(node):
        node[last] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(Problem(dotted(path), f"{dotted(path[:-1])} is a value, not a section", where))


def data_set(data: dict[str, Any], path: tuple[str | int, ...], value: Any) -> Any:
    node: Any = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return value
