"""Turn pydantic's validation errors into :class:`Problem` sentences.

Pydantic reports locations as tuples that include union-member tags
(``("data", "train", "list[DatasetEntry]", 0, "path")``); we walk the schema
along the location to drop those tags, to find the model that owns a key (for
the "allowed:" list of an unknown key) and to drop the noise of union branches
the user clearly did not mean.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from disagg.config.errors import Problem, allowed, did_you_mean
from disagg.config.source import SourceMap, dotted


def problems_from_validation(
    exc: ValidationError, root: type[BaseModel], source: SourceMap | None, prefix: Sequence[str | int] = ()
) -> list[Problem]:
    """One problem per real error, located via ``source``; ``prefix`` is
    prepended to locations (for sub-models validated on their own)."""
    return problems_from_errors(exc.errors(), root, source, prefix)


def problems_from_errors(
    errors: Sequence[dict[str, Any]],
    root: type[BaseModel],
    source: SourceMap | None,
    prefix: Sequence[str | int] = (),
) -> list[Problem]:
    """:func:`problems_from_validation` on ``ValidationError.errors()`` entries."""
    entries = []
    for err in errors:
        loc, owner, at_union = resolve(root, tuple(err["loc"]))
        entries.append(((*prefix, *loc), owner, at_union, err))
    # A union branch that failed on the type of the whole value is noise when
    # another branch got further (the user obviously meant that one).
    deeper = {e[0] for e in entries}
    kept, seen_union = [], set()
    for loc, owner, at_union, err in entries:
        if at_union:
            if any(len(other) > len(loc) and other[: len(loc)] == loc for other in deeper):
                continue
            if loc in seen_union:  # every branch failed on type: report once
                continue
            seen_union.add(loc)
        kept.append((loc, owner, at_union, err))
    return [_problem(loc, owner, at_union, err, source) for loc, owner, at_union, err in kept]


def _problem(
    loc: tuple, owner: type[BaseModel] | None, at_union: bool, err: dict[str, Any], source: SourceMap | None
) -> Problem:
    where = source.where(loc) if source else None
    kind, value = err["type"], err.get("input")
    if kind == "extra_forbidden":
        from disagg.config.schema import RENAMED_KEYS

        if tuple(loc[-2:]) in RENAMED_KEYS:
            return Problem(dotted(loc), RENAMED_KEYS[tuple(loc[-2:])], where)  # type: ignore[index]
        names = field_names(owner) if owner else []
        key = loc[-1]
        return Problem(dotted(loc), f"unknown key {key!r}; {allowed(names)}{did_you_mean(key, names)}", where)
    if kind == "missing":
        return Problem(dotted(loc), "required key is missing", where)
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", err.get("ctx", {}).get("expected", ""))
        return Problem(
            dotted(loc), f"{value!r} is not allowed; {allowed(choices)}{did_you_mean(value, choices)}", where
        )
    msg = err["msg"]
    msg = msg.removeprefix("Value error, ").replace("Input should be", "must be")
    if at_union:
        msg = "has the wrong type; " + msg
    if kind == "value_error":
        return Problem(dotted(loc), msg, where)
    return Problem(dotted(loc), f"{_short(value)} is invalid: {msg}", where)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def field_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def resolve(root: type, loc: tuple) -> tuple[tuple, type[BaseModel] | None, bool]:
    """(location without union tags, model owning the last key, whether the
    error sits right at a union)."""
    clean: list[Any] = []
    owner: type[BaseModel] | None = None
    cur: Any = root
    at_union = False
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        cur = _strip_optional(cur)
        at_union = False
        if _is_union(cur):
            member = _union_member(cur, part)
            if member is not None:
                cur, at_union = member, True
                if not parts:
                    break
                continue
        if isinstance(cur, type) and issubclass(cur, BaseModel):
            owner = cur
            field = cur.model_fields.get(part) if isinstance(part, str) else None
            cur = field.annotation if field else Any
        elif typing.get_origin(cur) in (list, tuple, set):
            args = typing.get_args(cur)
            cur = args[0] if args else Any
        elif typing.get_origin(cur) is dict:
            args = typing.get_args(cur)
            cur = args[1] if len(args) == 2 else Any
        else:
            cur = Any
        clean.append(part)
    return tuple(clean), owner, at_union


def _strip_optional(tp: Any) -> Any:
    if _is_union(tp):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return tp


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _union_member(tp: Any, tag: Any) -> Any:
    if not isinstance(tag, str):
        return None
    for member in typing.get_args(tp):
        name = member.__name__ if isinstance(member, type) and not typing.get_args(member) else str(member)
        # "list[disagg.config.schema.DatasetEntry]" -> "list[DatasetEntry]", as pydantic tags it
        if re.sub(r"\b[\w.]+\.(\w+)", r"\1", name) == tag:
            return member
    return None
