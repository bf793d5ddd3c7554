"""``train.modules.<m>.lora`` against the module's family and strategy, before any actor starts.

Targets are checked against the linears the family documents (its layer map),
so no weight is read: a target that cannot match, a rank that is not positive,
a strategy that cannot train adapters, a part to save the family does not
name, and a missing ``peft`` are each one problem naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from disagg.config.errors import did_you_mean
from disagg.interfaces import Family
from disagg.interfaces.lora import INSTALL_HINT
from disagg.kit import Strategy
from disagg.kit.lora import (
    documented_linears,
    layer_kinds,
    part_modules,
    pattern_can_match,
    peft_available,
    short_names,
)

Path = tuple[str | int, ...]
Found = list[tuple[Path, str]]


@dataclass(frozen=True)
class _Lora:
    """What every rule reads: the module's train section, its lora block, family and strategy."""

    m: str
    mt: Any
    family: Family
    strategy_cls: type[Strategy]
    strategy: str

    @property
    def lora(self) -> Any:
        return self.mt.lora

    @property
    def key(self) -> Path:
        return ("train", "modules", self.m, "lora")

    @property
    def support(self) -> bool | tuple[str, ...]:
        """The strategy's ``lora_support``: True, False, or the layer kinds it adapts."""
        return getattr(self.strategy_cls, "lora_support", True)


def lora_problems(
    m: str, mt: Any, family: Family, strategy_cls: type[Strategy], strategy: str
) -> list[tuple[Path, str]]:
    """(key, message) for each problem of ``train.modules.<m>.lora`` (``mt``: the module's train section),
    one rule after the other in this order."""
    if mt.lora is None:
        return []
    c = _Lora(m, mt, family, strategy_cls, strategy)
    out = _peft_missing(c) + _bad_rank(c) + _freeze_with_lora(c) + _strategy_cannot_adapt(c)
    try:
        linears = documented_linears(family.layer_map())
    except Exception as exc:  # nothing below can be judged without the family's linears
        return [*out, (c.key, f"family {family.name!r} cannot list its linears: {type(exc).__name__}: {exc}")]
    out += _no_linears(c, linears)
    if linears:
        for i, target in enumerate(c.lora.targets):
            out += _target_matches_nothing(c, linears, i, target) or _target_kind_refused(c, i, target)
    return out + _target_inside_saved_part(c, linears) + _unknown_saved_parts(c)


def _peft_missing(c: _Lora) -> Found:
    if peft_available():
        return []
    return [(c.key, f"LoRA needs the peft package, which is not installed; run: {INSTALL_HINT}")]


def _bad_rank(c: _Lora) -> Found:
    r = c.lora.r
    return [((*c.key, "r"), f"{r} is not a LoRA rank; use an integer > 0 (e.g. 8 or 16)")] if r <= 0 else []


def _freeze_with_lora(c: _Lora) -> Found:
    freeze = c.mt.freeze
    if not (freeze is True or (isinstance(freeze, list) and freeze)):
        return []
    return [
        (
            ("train", "modules", c.m, "freeze"),
            f"{freeze!r} is set together with lora: with lora the base weights are frozen and "
            "the adapters train; list parts to train in full in lora.modules_to_save, or remove lora",
        )
    ]


def _strategy_cannot_adapt(c: _Lora) -> Found:
    if c.support is not False:
        return []
    return [
        (
            c.key,
            f"strategy {c.strategy!r} (parallel.{c.m}.strategy) cannot train LoRA adapters; "
            "use ddp, ulysses or zero for this module, or remove lora",
        )
    ]


def _no_linears(c: _Lora, linears: list[str]) -> Found:
    if linears:
        return []
    return [
        (
            (*c.key, "targets"),
            f"family {c.family.name!r} documents no linear layers (its layer map), so LoRA targets "
            "cannot be checked on it",
        )
    ]


def _target_matches_nothing(c: _Lora, linears: list[str], i: int, target: str) -> Found:
    if any(pattern_can_match(p, target) for p in linears):
        return []
    names = short_names(linears)
    return [
        (
            (*c.key, "targets", i),
            f"{target!r} matches none of family {c.family.name!r}'s linear layers; allowed: "
            f"their names ({', '.join(names)}) or suffixes of "
            f"{', '.join(linears)}{did_you_mean(target, names)}",
        )
    ]


def _target_kind_refused(c: _Lora, i: int, target: str) -> Found:
    """A strategy that adapts only some layer kinds (``lora_support`` a tuple), given a target of another."""
    support = c.support
    if not isinstance(support, tuple):
        return []
    kinds = layer_kinds(c.family.layer_map())
    hit = sorted({k for k, ps in kinds.items() if any(pattern_can_match(p, target) for p in ps)})
    refused = [k for k in hit if k not in support]
    if not refused:
        return []
    return [
        (
            (*c.key, "targets", i),
            f"{target!r} names {' and '.join(refused)} linears of family {c.family.name!r}, "
            f"which strategy {c.strategy!r} cannot adapt (it adapts {', '.join(support)} "
            "linears only); name those, or train this module under another strategy",
        )
    ]


def _target_inside_saved_part(c: _Lora, linears: list[str]) -> Found:
    parts = c.family.parts()
    saved = {}
    for name in c.lora.modules_to_save:
        try:
            saved.update({m: name for m in part_modules(parts.get(name, ()))})
        except ValueError:
            pass  # reported by _unknown_saved_parts
    out: Found = []
    for i, target in enumerate(c.lora.targets):
        inside = sorted(
            {
                (p, saved[m])
                for p in linears
                for m in saved
                if p.startswith(m + ".") and pattern_can_match(p, target)
            }
        )
        if inside:
            p, part = inside[0]
            out.append(
                (
                    (*c.key, "targets", i),
                    f"{target!r} matches {p}, inside part {part!r} of modules_to_save, which trains in "
                    "full (PEFT adapts no layer of a module it saves); target other linears or remove "
                    f"{part!r} from modules_to_save",
                )
            )
    return out


def _unknown_saved_parts(c: _Lora) -> Found:
    parts = c.family.parts()
    out: Found = []
    for i, name in enumerate(c.lora.modules_to_save):
        if name not in parts:
            known = ", ".join(sorted(parts)) or "none"
            out.append(
                (
                    (*c.key, "modules_to_save", i),
                    f"unknown part {name!r}; family {c.family.name!r} names the parts: {known}"
                    f"{did_you_mean(name, sorted(parts))}",
                )
            )
            continue
        try:
            part_modules(parts[name])
        except ValueError as exc:
            out.append(((*c.key, "modules_to_save", i), f"part {name!r}: {exc}"))
    return out
