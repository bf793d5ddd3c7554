"""The machine a plan is for: devices per node, memory per device, bandwidths, FLOPs.

From a named preset (``h100x8``, ``h200x8``, ``cpu``), the command line
(``--gpus 8 --gpu-mem 80GiB --intra-bw 360GB/s --inter-bw 50GB/s --flops 989T``),
or the running Ray cluster (devices and memory per node; the rates come from a
preset of the same kind, because Ray does not know them).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Cluster:
    """Homogeneous nodes of identical devices."""

    name: str
    #: devices (GPUs, or CPU "devices" = actors' cores) per node
    devices_per_node: int
    nodes: int
    #: memory per device, bytes
    device_memory: int
    #: peak dense FLOP/s of one device at the compute dtype
    peak_flops: float
    #: fraction of the peak a well-tuned step reaches (model FLOPs utilisation)
    mfu: float
    #: bytes/s one device sends in a ring collective inside a node (NVLink) and across nodes
    intra_bw: float
    inter_bw: float
    #: fraction of ``device_memory`` a plan may fill (the rest: CUDA context,
    #: communicator buffers, allocator fragmentation)
    usable: float = 1.0
    #: compute dtype the plan assumes
    dtype: str = "bfloat16"

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def memory_budget(self) -> int:
        return int(self.device_memory * self.usable)

    def bandwidth(self, ranks: int) -> float:
        """A ring over ``ranks`` devices runs at the slowest link it crosses."""
        return self.intra_bw if ranks <= self.devices_per_node else self.inter_bw

    def describe(self) -> str:
        return (
            f"{self.name}: {self.nodes} node(s) x {self.devices_per_node} device(s), "
            f"{self.device_memory / 2**30:.1f} GiB each ({self.usable:.0%} usable), "
            f"{self.peak_flops / 1e12:.4g} TFLOP/s peak at {self.mfu:.0%} MFU, "
            f"links {self.intra_bw / 1e9:.4g} GB/s intra / {self.inter_bw / 1e9:.4g} GB/s inter, {self.dtype}"
        )

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


#: H100/H200 SXM: dense bf16 peak 989 TFLOP/s, NVLink 4 ring bandwidth ~360 GB/s per GPU
#: (NCCL bus bandwidth), 400 Gb/s InfiniBand per GPU across nodes; MFU 40%, as the
#: published prediction (disagg.bench.published) assumes.
PRESETS: dict[str, Cluster] = {
    "h100x8": Cluster("h100x8", 8, 1, 80 * 10**9, 989e12, 0.4, 360e9, 50e9),
    "h200x8": Cluster("h200x8", 8, 1, 141 * 10**9, 989e12, 0.4, 360e9, 50e9),
    # The CI machine: actors are CPU processes; float32; rates are rough orders of
    # magnitude for one core (gloo over shared memory), meant for ranking, not timing.
    "cpu": Cluster("cpu", os.cpu_count() or 1, 1, 8 * 2**30, 20e9, 0.5, 1e9, 1e9, dtype="float32"),
}

_SIZE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BINARY = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}


def parse_quantity(text: str, what: str) -> float:
    """``80GiB``, ``80GB``, ``360GB/s``, ``989T``, ``1e9`` -> a number (GiB binary, GB decimal)."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kmgtp]?)(i?)(?:b|flops?|flop/s)?(?:/s)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"{what}: {text!r} is not a quantity (e.g. 80GiB, 360GB/s, 989T, 1e9)")
    try:
        value = float(m.group(1))
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a quantity (e.g. 80GiB, 360GB/s, 989T, 1e9)") from None
    return value * (_BINARY if m.group(3) else _SIZE)[m.group(2)]


def cluster_from(
    preset: str | None = None, overrides: dict[str, Any] | None = None, *, ray_cluster: bool = False
) -> Cluster:
    """A preset (default ``h100x8``), then the Ray cluster's devices if asked,
    then explicit ``overrides`` (``gpus``, ``gpu_mem``, ``intra_bw``, ``inter_bw``,
    ``flops``, ``mfu``, ``nodes``, ``usable``; strings with units allowed)."""
    name = preset or "h100x8"
    if name not in PRESETS:
        raise ValueError(f"--cluster: unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
    c = PRESETS[name]
    if ray_cluster:
        c = _from_ray(c)
    o = {k: v for k, v in (overrides or {}).items() if v is not None}
    if "gpus" in o:
        c = replace(c, devices_per_node=int(o["gpus"]), name=f"{c.name}*")
    if "nodes" in o:
        c = replace(c, nodes=int(o["nodes"]))
    for key, field in (
        ("gpu_mem", "device_memory"),
        ("intra_bw", "intra_bw"),
        ("inter_bw", "inter_bw"),
        ("flops", "peak_flops"),
    ):
        if key in o:
            value = parse_quantity(o[key], f"--{key.replace('_', '-')}")
            c = replace(c, **{field: int(value) if field == "device_memory" else value}, name=f"{c.name}*")
    for key in ("mfu", "usable"):
        if key in o:
            c = replace(c, **{key: float(o[key])})
    if c.devices < 1 or c.device_memory <= 0 or c.peak_flops <= 0 or c.intra_bw <= 0 or c.inter_bw <= 0:
        raise ValueError(f"cluster {c.describe()}: every figure must be positive")
    return c


def _from_ray(base: Cluster) -> Cluster:
    """Devices per node and memory per GPU of the running Ray cluster (rates from ``base``)."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    gpus = [int(n["Resources"].get("GPU", 0)) for n in nodes]
    if any(gpus):
        per_node = max(gpus)
        memory = base.device_memory
        try:
            import torch

            if torch.cuda.is_available():
                memory = torch.cuda.get_device_properties(0).total_memory
        except Exception:  # the driver may have no GPU of its own: keep the preset's figure
            pass
        return replace(
            base,
            name=f"ray({base.name})",
            devices_per_node=per_node,
            nodes=sum(1 for g in gpus if g),
            device_memory=memory,
        )
    cpus = [int(n["Resources"].get("CPU", 0)) for n in nodes]
    per_node = max(1, min(max(cpus or [1]), os.cpu_count() or 1))
    mem = min(int(n["Resources"].get("memory", base.device_memory)) for n in nodes) // per_node
    return replace(base, name="ray(cpu)", devices_per_node=per_node, nodes=len(nodes), device_memory=mem)
