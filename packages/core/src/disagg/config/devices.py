"""Checks that need the device: GPU shares per placement and the transport's
fit to the layout. Run at validation (``train.device`` known or ``auto``) and
again by the plan once the device is resolved, before any actor starts: a
share Ray cannot grant would otherwise leave an actor waiting forever, and a
transport that cannot work would fail at the first step."""

from __future__ import annotations

from typing import Any

from disagg.config.schema import Config
from disagg.interfaces import Layout
from disagg.plugins import Registry

#: (dotted key path, message)
Found = list[tuple[tuple[str, ...], str]]


def group_size(group: Any) -> int:
    """Ranks of a ``parallel.<m>`` group: ``degree * context_parallel * replicas``."""
    return group.degree * getattr(group, "context_parallel", 1) * group.replicas


def layout_of(cfg: Config, device: str) -> Layout:
    return Layout(
        device,
        cfg.parallel.placement,
        {m: group_size(getattr(cfg.parallel, m)) for m in cfg.modules()},
    )


def gpu_share_problems(cfg: Config, device: str) -> Found:
    """``resources.num_gpus`` per placement. ``device``: ``cuda``, ``cpu`` or
    ``auto`` (unknown yet: shares that are wrong on any GPU are still refused)."""
    if device == "cpu":
        return []  # no GPU is asked for on CPU: the shares are not used
    out: Found = []
    modules = cfg.modules()
    groups = {m: getattr(cfg.parallel, m) for m in modules}
    key = {m: ("parallel", m, "resources", "num_gpus") for m in modules}
    for m, g in groups.items():
        n = g.resources.num_gpus
        if n == 0 and device == "cuda":
            out.append(
                (
                    key[m],
                    "0 on CUDA puts the rank outside Ray's GPU accounting (it sees no GPU, or one Ray "
                    "gives to others); use a positive share, or leave it unset for the default",
                )
            )
    if cfg.parallel.placement == "disaggregated":
        for m, g in groups.items():
            n = g.resources.num_gpus
            if n is not None and n > 0 and n != int(n):
                out.append(
                    (
                        key[m],
                        f"{n:g} is a fraction of a GPU, but disaggregated ranks need whole GPUs: Ray "
                        "may pack two ranks of the group on one GPU, where the group's NCCL world "
                        "refuses them ('duplicate GPU'); use 1 (the default), or placement: collocated "
                        "for fractional GPUs",
                    )
                )
        return out
    # collocated: rank i of every group lives in bundle i, which holds one GPU
    for m, g in groups.items():
        n = g.resources.num_gpus
        if n is not None and n > 1:
            out.append(
                (
                    key[m],
                    f"{n:g} GPUs per rank, but under collocated placement each rank shares one GPU with "
                    "the same rank of the other groups; use at most 1 (default: 1/number of groups "
                    "sharing the GPU), or placement: disaggregated",
                )
            )
    sizes = {m: group_size(g) for m, g in groups.items()}
    for i in range(max(sizes.values(), default=0)):
        members = [m for m in modules if sizes[m] > i]
        explicit = {m: groups[m].resources.num_gpus for m in members if groups[m].resources.num_gpus}
        if not explicit:
            continue  # the default splits the GPU evenly
        # the members without a share split what the explicit ones leave
        rest = [m for m in members if m not in explicit]
        total = sum(explicit.values())
        if total > 1 + 1e-9 or (rest and total >= 1):
            terms = " + ".join(f"parallel.{m}.resources.num_gpus={v:g}" for m, v in explicit.items())
            left = f", leaving nothing for {', '.join(rest)}" if rest else ""
            out.append(
                (
                    key[next(iter(explicit))],
                    f"GPU {i} is shared by rank {i} of {', '.join(members)}: {terms} = {total:g} of 1 GPU"
                    f"{left}; those ranks could never be placed; make the shares sum to at most 1",
                )
            )
            break  # bundle 0 holds every group: the same sum repeats on later GPUs
    return out


def cluster_gpu_problems(cfg: Config, cluster_gpus: float, cluster_cpus: float | None = None) -> Found:
    """GPUs asked for (``train.device: cuda``, a positive ``resources.num_gpus``) on a Ray
    cluster that has none: refused before any actor, instead of a placement that waits
    until ``parallel.start_timeout_s`` for GPUs that will never come."""
    if cluster_gpus > 0 or cfg.train.device == "cpu":
        return []  # on CPU the shares are not used
    cpus = f", {cluster_cpus:g} CPUs" if cluster_cpus is not None else ""
    has = f"the Ray cluster has 0 GPUs{cpus}"
    out: Found = []
    if cfg.train.device == "cuda":
        out.append(
            (
                ("train", "device"),
                f"'cuda' asks for GPUs, but {has}; use train.device: cpu (or auto: the devices the "
                "cluster has), or run on a cluster with GPUs (ray.address / --address)",
            )
        )
    for m in cfg.modules():
        n = getattr(cfg.parallel, m).resources.num_gpus
        if n:
            out.append(
                (
                    ("parallel", m, "resources", "num_gpus"),
                    f"{n:g} GPU(s) per rank asked for, but {has}; remove it (train.device: auto then "
                    "runs on the CPUs), or run on a cluster with GPUs (ray.address / --address)",
                )
            )
    return out


def transport_problems(cfg: Config, registry: Registry, device: str) -> Found:
    """The configured transport against the device and the layout (``auto`` always fits)."""
    name = cfg.parallel.transport
    cls = registry.transports.get(name)
    if name == "auto" or cls is None or cls.unavailable_reason:
        return []  # unknown / unavailable names are reported by validation itself
    key = ("parallel", "transport")
    if device != "auto" and device not in cls.devices:
        fits = sorted(n for n, t in registry.transports.items() if device in t.devices)
        return [(key, f"{name!r} does not work on {device}; allowed there: auto, {', '.join(fits)}")]
    reason = cls.refuse(layout_of(cfg, device))
    return [(key, f"{name!r} cannot work in this layout: {reason}")] if reason else []
