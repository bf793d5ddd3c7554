"""The ``parallel`` section as a whole, and the Ray that must hold it: groups set for modules
that are not configured, the transport, the devices' fit to the layout, and the CPUs an
embedded Ray offers the ranks."""

from __future__ import annotations

from disagg.config.errors import allowed, did_you_mean
from disagg.config.problems import Problems
from disagg.config.resolved import ResolvedConfig, reserved_cpus
from disagg.config.schema import MODULES, Config, GroupConfig
from disagg.plugins import Registry


def check_unused_groups(cfg: Config, out: Problems) -> None:
    default = GroupConfig().model_dump()
    configured = cfg.modules()
    for m in MODULES:
        if m not in configured and getattr(cfg.parallel, m).model_dump() != default:
            out.add(
                ("parallel", m),
                f"is set but model.{m} is not configured; add model.{m} or remove parallel.{m}",
            )


def check_ray(cfg: Config, resolved: ResolvedConfig, out: Problems) -> None:
    """An embedded Ray too small for the ranks would wait forever for actors."""
    n = cfg.ray.num_cpus
    if n is None or cfg.ray.address:
        return
    need = reserved_cpus(resolved)
    if n < need:
        out.add(
            ("ray", "num_cpus"),
            f"{n} logical CPUs cannot hold the ranks, which reserve {need:g} "
            "(degree x replicas x resources.num_cpus per module); raise it, or remove it "
            "for the default max(8, cores, reserved + 2)",
        )


def check_transport(cfg: Config, reg: Registry, out: Problems) -> None:
    name = cfg.parallel.transport
    names = ["auto", *reg.transport_names()]
    if name not in names:
        out.add(
            ("parallel", "transport"),
            f"unknown transport {name!r}; {allowed(names)}{did_you_mean(name, names)}",
        )
        return
    cls = reg.transports.get(name)
    if cls is not None and cls.unavailable_reason:
        usable = ["auto", *(n for n, t in reg.transports.items() if not t.unavailable_reason)]
        out.add(
            ("parallel", "transport"),
            f"{name!r} cannot be used: {cls.unavailable_reason}; {allowed(usable)}",
        )


def check_devices(cfg: Config, reg: Registry, out: Problems) -> None:
    """GPU shares and the transport's fit to the layout, for the configured
    device (``auto``: what is wrong on any device; the plan checks again
    once the device is known)."""
    from disagg.config.devices import gpu_share_problems, transport_problems

    device = cfg.train.device
    out.add_all(gpu_share_problems(cfg, device) + transport_problems(cfg, reg, device))
