"""From a validated config to what the orchestrator needs: families, group
specs, optimizer settings, device, dtype and transport."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from disagg.config.resolved import ResolvedConfig, require_resolved, role_of
from disagg.config.schema import Config
from disagg.interfaces import Family, OptimSpec, PartGroup, Transport
from disagg.interfaces.family import link_to_llm
from disagg.plugins import Registry
from disagg.runtime.groups import GroupSpec


@dataclass
class Plan:
    families: dict[str, Family]
    specs: list[GroupSpec]
    device: str
    #: ``train.precision`` resolved: ``fp32``, ``bf16`` or ``bf16-pure``
    precision: str
    transport: Transport


def families_for(cfg: Config, registry: Registry) -> dict[str, Family]:
    """Family instances of a config's modules (for code that has no
    :class:`ResolvedConfig` at hand: export, data tools, tests)."""
    out = {}
    for m in cfg.modules():
        mm = getattr(cfg.model, m)
        out[m] = registry.family(role_of(m), mm.family)(mm.path, mm.options)
    link_to_llm(out)
    return out


def optim_for(cfg: Config, module: str, family: Family | None = None) -> OptimSpec | None:
    """``train.*`` merged with ``train.modules.<module>.*``; None when the whole
    module is frozen. Part names (``freeze: [..]``, ``param_groups``) resolve to
    parameter-name patterns through ``family.parts()`` (validation has checked them)."""
    t = cfg.train
    o = t.modules.get(module)
    if o is not None and o.freeze is True:
        return None

    def pick(name: str) -> Any:
        v = getattr(o, name, None) if o is not None else None
        return getattr(t, name) if v is None else v

    parts = family.parts() if family is not None else {}
    frozen: tuple[tuple[str, tuple[str, ...]], ...] = ()
    groups: tuple[PartGroup, ...] = ()
    if o is not None and ((isinstance(o.freeze, list) and o.freeze) or o.param_groups):
        if family is None:
            raise ValueError(f"train.modules.{module}: part names need the module's family to resolve")
        names = o.freeze if isinstance(o.freeze, list) else []
        frozen = tuple((n, tuple(parts[n])) for n in dict.fromkeys(names))
        groups = tuple(
            PartGroup(
                part=n,
                patterns=tuple(parts[n]),
                lr=pick("lr") if g.lr is None else g.lr,
                weight_decay=pick("weight_decay") if g.weight_decay is None else g.weight_decay,
            )
            for n, g in o.param_groups.items()
        )
    lora = None
    if o is not None and o.lora is not None:
        from disagg.interfaces.lora import LoraSpec
        from disagg.kit.lora import part_modules

        if o.lora.modules_to_save and family is None:
            raise ValueError(f"train.modules.{module}.lora: part names need the module's family to resolve")
        saved = [parts[n] for n in o.lora.modules_to_save]
        lora = LoraSpec(
            r=o.lora.r,
            alpha=o.lora.alpha,
            dropout=o.lora.dropout,
            targets=tuple(o.lora.targets),
            modules_to_save=tuple(m for p in saved for m in part_modules(tuple(p))),
            save_patterns=tuple(dict.fromkeys(p for ps in saved for p in ps)),
            seed=t.seed,
        )
    return OptimSpec(
        lr=pick("lr"),
        weight_decay=pick("weight_decay"),
        betas=tuple(t.betas),  # type: ignore[arg-type]
        eps=t.eps,
        scheduler=pick("scheduler"),
        warmup_steps=pick("warmup_steps"),
        total_steps=t.steps,
        frozen=frozen,
        groups=groups,
        lora=lora,
    )


def make_plan(
    resolved: ResolvedConfig, registry: Registry, cluster_gpus: float, cluster_cpus: float | None = None
) -> Plan:
    """Group specs from the strategies, options and families validation
    already resolved (nothing is looked up or checked twice); only the checks
    that need the cluster's devices run here (``cluster_cpus``: named in their messages)."""
    resolved = require_resolved(resolved, "make_plan")
    cfg = resolved.config
    from disagg.config.devices import cluster_gpu_problems

    found = cluster_gpu_problems(cfg, cluster_gpus, cluster_cpus)
    if found:
        from disagg.config.errors import ConfigError, Problem
        from disagg.config.source import dotted

        raise ConfigError([Problem(dotted(path), message) for path, message in found])
    device, precision = resolve_device_precision(cfg.train.device, cfg.train.precision, cluster_gpus)
    if cfg.train.device == "auto" and cfg.train.precision == "auto":  # validation could not tell
        from disagg.config.errors import ConfigError, Problem
        from disagg.config.source import dotted
        from disagg.config.train_checks import precision_problems

        found = precision_problems(resolved, device)
        if found:
            raise ConfigError([Problem(dotted(path), message) for path, message in found])
    families = {m: r.family for m, r in resolved.modules.items()}
    specs = []
    for m in cfg.modules():
        g = getattr(cfg.parallel, m)
        r = resolved.modules[m]
        specs.append(
            GroupSpec(
                module=m,
                family=r.family,
                strategy_cls=r.strategy,
                options=r.options,
                degree=r.degree,
                replicas=r.replicas,
                context_parallel=r.context_parallel,
                optim=optim_for(cfg, m, r.family),
                num_cpus=g.resources.num_cpus,
                num_gpus=g.resources.num_gpus,
            )
        )
    name = resolve_transport(cfg, registry, device)
    return Plan(families, specs, device, precision, registry.transports[name]())


def resolve_device_precision(device: str, precision: str, cluster_gpus: float) -> tuple[str, str]:
    """``train.device`` and ``train.precision`` with ``auto`` resolved: CUDA when the
    Ray cluster (not the driver) has GPUs; ``bf16`` on CUDA, ``fp32`` on CPU."""
    from disagg.interfaces.precision import resolve_precision

    if device == "auto":
        device = "cuda" if cluster_gpus > 0 else "cpu"
    return device, resolve_precision(precision, device).name


def resolve_transport(cfg: Config, registry: Registry, device: str) -> str:
    """The transport's name (``auto`` resolved for ``device`` and the layout),
    after the checks that need the device when validation could not know it
    (``train.device: auto``): GPU shares and the transport's fit
    (:mod:`disagg.config.devices`); raises :class:`ConfigError` naming the key."""
    from disagg.builtin.transports import auto_transport
    from disagg.config.devices import Found, gpu_share_problems, layout_of, transport_problems
    from disagg.config.errors import ConfigError, Problem
    from disagg.config.source import dotted

    found: Found = []
    if cfg.train.device == "auto":  # validation checked a known device already; this one it could not
        found = gpu_share_problems(cfg, device) + transport_problems(cfg, registry, device)
    name = cfg.parallel.transport
    if name == "auto":
        name = auto_transport(layout_of(cfg, device), registry.transports)
    if found:
        raise ConfigError([Problem(dotted(path), message) for path, message in found])
    return name
