"""The ``train`` section against the plugins: per-module settings (parts to freeze or give
their own optimizer settings, LoRA), the schedule, the LR scheduler, and ``train.precision``
against every module's strategy."""

from __future__ import annotations

from typing import Any

from disagg.config.errors import allowed, did_you_mean
from disagg.config.problems import Problems
from disagg.config.resolved import ResolvedConfig, ResolvedModule
from disagg.config.schema import Config
from disagg.interfaces import Family
from disagg.plugins import Registry


def check_train(cfg: Config, reg: Registry, resolved: ResolvedConfig, out: Problems) -> None:
    t = cfg.train
    configured = cfg.modules()
    for m, mt in t.modules.items():
        if m not in configured:
            out.add(
                ("train", "modules", m), f"module {m!r} is not configured in model; {allowed(configured)}"
            )
        elif m in resolved.modules:
            _parts(m, mt, resolved.modules[m].family, out)
            _lora(cfg, m, mt, resolved.modules[m], out)
    if t.schedule not in reg.schedules:
        names = sorted(reg.schedules)
        out.add(
            ("train", "schedule"),
            f"unknown schedule {t.schedule!r}; {allowed(names)}{did_you_mean(t.schedule, names)}",
        )
    kinds = _scheduler_kinds()
    for path, kind in [(("train", "scheduler"), t.scheduler)] + [
        (("train", "modules", m, "scheduler"), mt.scheduler) for m, mt in t.modules.items() if mt.scheduler
    ]:
        if kinds and kind not in kinds:
            out.add(path, f"unknown scheduler {kind!r}; {allowed(kinds)}{did_you_mean(kind, kinds)}")


def _lora(cfg: Config, m: str, mt: Any, module: ResolvedModule, out: Problems) -> None:
    """``train.modules.<m>.lora`` (:mod:`disagg.config.lora_checks`)."""
    from disagg.config.lora_checks import lora_problems

    strategy = getattr(cfg.parallel, m).strategy
    out.add_all(lora_problems(m, mt, module.family, module.strategy, strategy))


def _parts(m: str, mt: Any, family: Family, out: Problems) -> None:
    """Part names in ``freeze: [..]`` and ``param_groups`` are the family's."""
    key = ("train", "modules", m)
    try:
        parts = family.parts()
    except Exception as exc:
        out.add(key, f"family {family.name!r} cannot list its parts: {type(exc).__name__}: {exc}")
        return
    names = sorted(parts)
    if names:
        known = f"family {family.name!r} names the parts: {', '.join(names)}"
    else:
        known = f"family {family.name!r} names no parts (use freeze: true or false)"
    listed = mt.freeze if isinstance(mt.freeze, list) else []
    frozen = {pattern for n in listed if n in parts for pattern in parts[n]}
    for i, name in enumerate(listed):
        if name not in parts:
            out.add((*key, "freeze", i), f"unknown part {name!r}; {known}{did_you_mean(name, names)}")
    for name in mt.param_groups:
        if name not in parts:
            out.add(
                (*key, "param_groups", name), f"unknown part {name!r}; {known}{did_you_mean(name, names)}"
            )
        elif mt.freeze is True or name in listed or set(parts[name]) <= frozen:
            out.add(
                (*key, "param_groups", name),
                f"part {name!r} is frozen (train.modules.{m}.freeze), so it has no optimizer settings; "
                "remove it from param_groups or from freeze",
            )


def _scheduler_kinds() -> list[str]:
    try:
        from transformers import SchedulerType
    except ImportError:  # validation should not depend on it; the run will complain
        return []
    return [s.value for s in SchedulerType]


def check_precision(cfg: Config, resolved: ResolvedConfig, out: Problems) -> None:
    """``train.precision`` against every module's strategy (``auto`` once the device is
    known; on ``train.device: auto`` the plan checks it again, before any actor starts)."""
    device = cfg.train.device
    if cfg.train.precision == "auto" and device == "auto":
        return
    out.add_all(precision_problems(resolved, device))


def precision_problems(resolved: ResolvedConfig, device: str) -> list[tuple[tuple[str, ...], str]]:
    """``train.precision`` (``auto`` resolved for ``device``) for each module whose strategy
    does not list it in :attr:`Strategy.precisions`: the key, the module, the strategy, and the
    recipes it honours."""
    from disagg.interfaces.precision import resolve_precision

    name = resolved.config.train.precision
    recipe = resolve_precision(name, device).name
    said = repr(name) if name != "auto" else f"auto (resolved to {recipe!r} on {device})"
    out = []
    for m, module in resolved.modules.items():
        if recipe == "bf16" and getattr(module.options, "overlap_grad_reduce", False):
            out.append(
                (
                    ("parallel", m, "overlap_grad_reduce"),
                    f"true cannot be combined with train.precision: {said} (its buckets would sum "
                    "the bf16 gradients, not the float32 ones the recipe reduces); set "
                    "overlap_grad_reduce: false or train.precision: fp32 / bf16-pure",
                )
            )
        allowed_here = tuple(module.strategy.precisions)
        if recipe in allowed_here:  # honoured, but maybe not with every option
            for msg in module.strategy.precision_problems(recipe, module.options, f"parallel.{m}"):
                out.append((("train", "precision"), msg))
        else:
            strategy = getattr(resolved.config.parallel, m).strategy
            out.append(
                (
                    ("train", "precision"),
                    f"{said} is not honoured by strategy {strategy!r} of module {m!r} "
                    f"(parallel.{m}.strategy); it honours: {', '.join(allowed_here)}; set "
                    f"train.precision to one of those or pick another strategy for {m}",
                )
            )
    return out
