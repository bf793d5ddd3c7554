"""``train.modules.<m>.lora`` against the module's family and strategy, before any actor starts.

Targets are checked against the linears the family documents (its layer map),
so no weight is read: a target that cannot match, a rank that is not positive,
a strategy that cannot train adapters, a part to save the family does not
name, and a missing ``peft`` are each one problem naming the key.
"""

from __future__ import annotations

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


def lora_problems(
    m: str, mt: Any, family: Family, strategy_cls: type[Strategy], strategy: str
) -> list[tuple[Path, str]]:
    """(key, message) for each problem of ``train.modules.<m>.lora`` (``mt``: the module's train section)."""
    lora = mt.lora
    if lora is None:
        return []
    key: Path = ("train", "modules", m, "lora")
    out: list[tuple[Path, str]] = []
    if not peft_available():
        out.append((key, f"LoRA needs the peft package, which is not installed; run: {INSTALL_HINT}"))
    if lora.r <= 0:
        out.append(((*key, "r"), f"{lora.r} is not a LoRA rank; use an integer > 0 (e.g. 8 or 16)"))
    if mt.freeze is True or (isinstance(mt.freeze, list) and mt.freeze):
        out.append(
            (
                ("train", "modules", m, "freeze"),
                f"{mt.freeze!r} is set together with lora: with lora the base weights are frozen and "
                "the adapters train; list parts to train in full in lora.modules_to_save, or remove lora",
            )
        )
    support = getattr(strategy_cls, "lora_support", True)
    if support is False:
        out.append(
            (
                key,
                f"strategy {strategy!r} (parallel.{m}.strategy) cannot train LoRA adapters; "
                "use ddp, ulysses or zero for this module, or remove lora",
            )
        )
    try:
        linears = documented_linears(family.layer_map())
    except Exception as exc:
        out.append((key, f"family {family.name!r} cannot list its linears: {type(exc).__name__}: {exc}"))
        return out
    if not linears:
        out.append(
            (
                (*key, "targets"),
                f"family {family.name!r} documents no linear layers (its layer map), so LoRA targets "
                "cannot be checked on it",
            )
        )
    else:
        names = short_names(linears)
        kinds = layer_kinds(family.layer_map())
        for i, target in enumerate(lora.targets):
            if not any(pattern_can_match(p, target) for p in linears):
                out.append(
                    (
                        (*key, "targets", i),
                        f"{target!r} matches none of family {family.name!r}'s linear layers; allowed: "
                        f"their names ({', '.join(names)}) or suffixes of "
                        f"{', '.join(linears)}{did_you_mean(target, names)}",
                    )
                )
                continue
            if isinstance(support, tuple):
                hit = sorted({k for k, ps in kinds.items() if any(pattern_can_match(p, target) for p in ps)})
                refused = [k for k in hit if k not in support]
                if refused:
                    out.append(
                        (
                            (*key, "targets", i),
                            f"{target!r} names {' and '.join(refused)} linears of family {family.name!r}, "
                            f"which strategy {strategy!r} cannot adapt (it adapts {', '.join(support)} "
                            "linears only); name those, or train this module under another strategy",
                        )
                    )
    parts = family.parts()
    saved = {}
    for name in lora.modules_to_save:
        try:
            saved.update({m: name for m in part_modules(parts.get(name, ()))})
        except ValueError:
            pass  # reported below
    for i, target in enumerate(lora.targets):
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
                    (*key, "targets", i),
                    f"{target!r} matches {p}, inside part {part!r} of modules_to_save, which trains in "
                    "full (PEFT adapts no layer of a module it saves); target other linears or remove "
                    f"{part!r} from modules_to_save",
                )
            )
    for i, name in enumerate(lora.modules_to_save):
        if name not in parts:
            known = ", ".join(sorted(parts)) or "none"
            out.append(
                (
                    (*key, "modules_to_save", i),
                    f"unknown part {name!r}; family {family.name!r} names the parts: {known}"
                    f"{did_you_mean(name, sorted(parts))}",
                )
            )
            continue
        try:
            part_modules(parts[name])
        except ValueError as exc:
            out.append(((*key, "modules_to_save", i), f"part {name!r}: {exc}"))
    return out
