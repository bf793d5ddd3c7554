"""The machine a plan is for: devices per node, memory per device, bandwidths,
FLOPs, and the fixed latencies that dominate small steps.

From a named preset (``h100x8``, ``h200x8``, ``cpu``; ``cpu-local`` is ``cpu``
with this machine's figures measured now, :mod:`disagg.plan.calibrate`), a JSON
file written by ``disagg plan --calibrate FILE``, the command line (``--gpus 8
--gpu-mem 80GiB --intra-bw 360GB/s --inter-bw 50GB/s --flops 989T
--intra-latency 2us``), or the running Ray cluster (devices and memory per
node; the rates come from a preset of the same kind, because Ray does not know
them).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from disagg.kit.cost.offload import HOST_MEMORY_BYTES


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
    #: fraction of the peak the largest, best-shaped matmuls reach: the ceiling of the
    #: efficiency curve (:mod:`disagg.plan.efficiency`); on a cluster without the curve
    #: (all of ``gemm_ridge``, ``gemm_tile``, ``compute_units``, ``mem_bw`` 0) every FLOP runs at it
    mfu: float
    #: bytes/s one device sends in a ring collective inside a node (NVLink) and across nodes
    intra_bw: float
    inter_bw: float
    #: fraction of ``device_memory`` a plan may fill (the rest: CUDA context,
    #: communicator buffers, allocator fragmentation)
    usable: float = 1.0
    #: the precision recipe a plan assumes where the config's ``train.precision`` is ``auto``
    #: (``bf16`` on GPUs, ``fp32`` on CPUs, as ``auto`` resolves; :data:`disagg.interfaces.precision.RECIPES`)
    precision: str = "bf16"
    #: α of the α-β model: seconds per message step of a collective inside a node
    #: and across nodes (a ring all-reduce over ``p`` ranks takes ``2(p-1)`` steps;
    #: :func:`disagg.plan.model.collective_seconds`)
    intra_latency: float = 0.0
    inter_latency: float = 0.0
    #: fixed seconds per layer per microbatch, forward + backward, whatever its size:
    #: kernel launches (GPU) or eager dispatch of its ops (CPU)
    layer_overhead: float = 0.0
    #: launches are asynchronous (CUDA streams): the host's per-layer cost hides under
    #: the device's work and only the part of it beyond the compute time counts;
    #: eager CPU execution is synchronous, so there it adds up
    async_launch: bool = False
    #: seconds per driver -> actor call of the step (each carries a microbatch, its
    #: rows or their gradients through the object store)
    call_latency: float = 0.0
    #: the efficiency curve (:func:`disagg.plan.efficiency.efficiency`): FLOPs per byte at which
    #: a matmul's operand traffic takes as long as its arithmetic at the ceiling (0: never memory bound)
    gemm_ridge: float = 0.0
    #: side of the output tile a matmul kernel computes (0: no tile quantization)
    gemm_tile: int = 0
    #: tiles that run at once (SMs; 0: no wave quantization)
    compute_units: int = 0
    #: bytes/s element-wise kernels stream (0: element-wise work not charged)
    mem_bw: float = 0.0
    #: where the figures come from: ``preset`` or ``measured on <host> ...``
    source: str = "preset"
    #: devices are CUDA GPUs: a device's memory counts the allocator's view (CUDA contexts, NCCL
    #: buffers, the step's transient, fragmentation: :mod:`disagg.kit.cost.memory`); on CPU
    #: actors only the tensors count
    cuda_allocator: bool = False
    #: host memory per node, bytes, that offloaded state (``offload: optimizer``) may fill: a plan
    #: whose ranks on one node hold more in host memory does not fit (0: not checked, e.g. CPU
    #: actors, whose "device" memory is the host's)
    host_memory: int = 0

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def memory_budget(self) -> int:
        return int(self.device_memory * self.usable)

    def bandwidth(self, ranks: int) -> float:
        """A ring over ``ranks`` devices runs at the slowest link it crosses."""
        return self.intra_bw if ranks <= self.devices_per_node else self.inter_bw

    def latency(self, ranks: int) -> float:
        """α per message step of a collective over ``ranks`` devices (the slowest hop)."""
        return self.intra_latency if ranks <= self.devices_per_node else self.inter_latency

    def describe(self) -> str:
        return (
            f"{self.name}: {self.nodes} node(s) x {self.devices_per_node} device(s), "
            f"{self.device_memory / 2**30:.1f} GiB each ({self.usable:.0%} usable), "
            f"{self.peak_flops / 1e12:.4g} TFLOP/s peak at {self.mfu:.0%} MFU, "
            f"links {self.intra_bw / 1e9:.4g} GB/s intra / {self.inter_bw / 1e9:.4g} GB/s inter, "
            f"latency {self.intra_latency * 1e6:.3g} us intra / {self.inter_latency * 1e6:.3g} us inter "
            "per step, "
            f"{self.layer_overhead * 1e3:.3g} ms per layer pass, {self.call_latency * 1e3:.3g} ms per call, "
            + self._curve()
            + (f"host {self.host_memory / 1e12:.3g} TB per node for offload, " if self.host_memory else "")
            + f"precision {self.precision} ({self.source})"
        )

    def _curve(self) -> str:
        if not (self.gemm_ridge or self.gemm_tile or self.compute_units or self.mem_bw):
            return "every FLOP at the MFU, "
        return (
            f"matmuls memory-bound below {self.gemm_ridge:.4g} FLOP/B, tiles {self.gemm_tile}, "
            f"{self.compute_units} units, element-wise at {self.mem_bw / 1e9:.4g} GB/s, "
        )

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


#: H100/H200 SXM: dense bf16 peak 989 TFLOP/s, NVLink 4 ring bandwidth ~360 GB/s per GPU
#: (NCCL bus bandwidth), 400 Gb/s InfiniBand per GPU across nodes.
#: The efficiency curve (disagg.plan.efficiency): the ceiling 0.8 is the "maximum achievable
#: matmul FLOPS" measured on an H100 SXM (~794 TFLOP/s bf16 in Stas Bekman's ml-engineering
#: MAMF table, 792-821 in mag-/gpu_benchmark's runs of the same finder); the H200 has the same
#: compute die, so the same ceiling is assumed. Memory bandwidth from NVIDIA's datasheets
#: (H100 SXM HBM3 3.35 TB/s, H200 HBM3e 4.8 TB/s), which element-wise kernels are assumed to
#: stream at; the ridge is derived from them, ceiling x peak / bandwidth (236 and 165 FLOP/B).
#: 132 SMs (both), output tiles of 128 x 128 (cuBLAS's common bf16 tile on Hopper; an assumption).
#: Latencies: nccl-tests' all_reduce_perf on one 8-GPU NVLink node takes ~15-20 us for
#: a few bytes, i.e. ~1.5 us per ring step (14 steps); across nodes NCCL's small-message
#: latency over InfiniBand is several times that (~5 us per step: NIC + proxy thread).
#: A CUDA kernel launch costs ~5 us of host time and a transformer layer's forward +
#: backward is ~40 kernels in eager PyTorch (0.2 ms, hidden under the device's work
#: unless the layer computes for less than that). One Ray actor call round trip is ~0.5 ms (Ray's release
#: microbenchmark, "1:1 actor calls sync", ~2k calls/s).
def _gpu_curve(mem_bw: float, ceiling: float = 0.8, peak: float = 989e12) -> dict[str, float | int]:
    return {"gemm_ridge": ceiling * peak / mem_bw, "gemm_tile": 128, "compute_units": 132, "mem_bw": mem_bw}


_GPU_LATENCY = {
    "intra_latency": 1.5e-6,
    "inter_latency": 5e-6,
    "layer_overhead": 2e-4,
    "async_launch": True,
    "call_latency": 5e-4,
    "cuda_allocator": True,
    # a plan on GPUs keeps 10% of each device beyond what the memory model counts (contexts, NCCL
    # buffers, the transient and fragmentation are counted: disagg.kit.cost.memory)
    "usable": 0.9,
}
#: Host memory per node: NVIDIA's DGX H100 and DGX H200 datasheets both list 2 TB of system
#: memory (disagg.kit.cost.offload.HOST_MEMORY_BYTES); offloaded state may fill 70% of it,
#: because Ray's object store reserves 30% of a node's memory by default (Ray docs, "Memory
#: Management": object_store_memory defaults to 30% of available memory) and the tensors shipped
#: between groups live there.
HOST_USABLE = 0.7
_GPU = {**_GPU_LATENCY, "host_memory": int(HOST_USABLE * HOST_MEMORY_BYTES)}
PRESETS: dict[str, Cluster] = {
    "h100x8": Cluster("h100x8", 8, 1, 80 * 10**9, 989e12, 0.8, 360e9, 50e9, **_GPU, **_gpu_curve(3.35e12)),  # noqa: E501
    "h200x8": Cluster("h200x8", 8, 1, 141 * 10**9, 989e12, 0.8, 360e9, 50e9, **_GPU, **_gpu_curve(4.8e12)),  # noqa: E501
    # The CI machine: actors are CPU processes; float32; rates are rough orders of
    # magnitude for one core (gloo over shared memory, a loopback TCP round trip
    # ~50 us per step), eager PyTorch dispatch ~10 us per op and ~60 ops per layer
    # forward + backward; meant for ranking, not timing. ``cpu-local`` (or
    # ``disagg plan --calibrate``) measures them instead.
    "cpu": Cluster(
        "cpu",
        os.cpu_count() or 1,
        1,
        8 * 2**30,
        20e9,
        0.5,
        1e9,
        1e9,
        precision="fp32",
        intra_latency=5e-5,
        inter_latency=5e-5,
        layer_overhead=6e-4,
        call_latency=5e-4,
    ),
}
#: presets measured on this machine when asked for (:func:`disagg.plan.calibrate.calibrate`)
MEASURED = {"cpu-local": "cpu"}

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
    preset: str | Cluster | None = None, overrides: dict[str, Any] | None = None, *, ray_cluster: bool = False
) -> Cluster:
    """A preset (default ``h100x8``; ``cpu-local`` measures this machine) or a
    cluster JSON file (``disagg plan --calibrate FILE``), then the Ray cluster's
    devices if asked, then explicit ``overrides`` (``gpus``, ``gpu_mem``,
    ``intra_bw``, ``inter_bw``, ``flops``, ``mfu``, ``nodes``, ``usable``,
    ``intra_latency``, ``inter_latency``, ``layer_overhead``, ``call_latency``, the
    efficiency curve's ``gemm_ridge``, ``gemm_tile``, ``compute_units``, ``mem_bw``;
    strings with units allowed)."""
    name = preset or "h100x8"
    if isinstance(name, Cluster):
        c = name
    elif name in MEASURED:
        from disagg.plan.calibrate import calibrate

        c = calibrate(PRESETS[MEASURED[name]], name=name)
    elif name in PRESETS:
        c = PRESETS[name]
    elif name.endswith(".json"):
        c = load_cluster(name)
    else:
        allowed = ", ".join([*PRESETS, *MEASURED, "FILE.json"])
        raise ValueError(f"--cluster: unknown preset {name!r}; allowed: {allowed}")
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
        ("mem_bw", "mem_bw"),
    ):
        if key in o:
            value = parse_quantity(o[key], f"--{key.replace('_', '-')}")
            c = replace(c, **{field: int(value) if field == "device_memory" else value}, name=f"{c.name}*")
    for key in ("intra_latency", "inter_latency", "layer_overhead", "call_latency"):
        if key in o:
            value = parse_seconds(o[key], f"--{key.replace('_', '-')}")
            c = replace(c, **{key: value}, name=f"{c.name}*")
    for key in ("mfu", "usable", "gemm_ridge", "gemm_tile", "compute_units"):
        if key in o:
            kind = int if key in ("gemm_tile", "compute_units") else float
            try:
                value = kind(o[key])
            except (TypeError, ValueError):
                raise ValueError(f"--{key.replace('_', '-')}: {o[key]!r} is not a number") from None
            c = replace(c, **{key: value}, name=f"{c.name}*" if key.startswith(("gemm", "comp")) else c.name)
    curve = (c.gemm_ridge, c.gemm_tile, c.compute_units, c.mem_bw)
    if not 0 < c.mfu <= 1 or any(x < 0 or x != x for x in curve):
        raise ValueError(
            f"cluster {c.describe()}: mfu must be in (0, 1]; gemm_ridge, gemm_tile, compute_units "
            "and mem_bw >= 0 (0: not charged)"
        )
    if c.devices < 1 or c.device_memory <= 0 or c.peak_flops <= 0 or c.intra_bw <= 0 or c.inter_bw <= 0:
        raise ValueError(f"cluster {c.describe()}: every figure must be positive")
    latencies = (c.intra_latency, c.inter_latency, c.layer_overhead, c.call_latency)
    if any(x < 0 or x != x for x in latencies):
        raise ValueError(f"cluster {c.describe()}: latencies must be finite and >= 0")
    return c


_SECONDS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_seconds(text: Any, what: str) -> float:
    """``2us``, ``0.5ms``, ``1e-5`` -> seconds."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(s|ms|us|µs|ns)?\s*", str(text).lower())
    try:
        return float(m.group(1)) * _SECONDS[m.group(2) or ""]  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        raise ValueError(f"{what}: {text!r} is not a duration (e.g. 2us, 0.5ms, 1e-5)") from None


def load_cluster(path: str | Path) -> Cluster:
    """A cluster description written by ``disagg plan --calibrate FILE`` (or by hand)."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--cluster: cannot read {path}: {exc}") from None
    if "dtype" in raw and "precision" not in raw:  # written before the precision recipes
        raw["precision"] = "fp32" if raw.pop("dtype") == "float32" else "bf16"
    known = {f.name for f in fields(Cluster)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"--cluster {path}: unknown keys {unknown}; allowed: {', '.join(sorted(known))}")
    try:
        return Cluster(**raw)
    except TypeError as exc:
        raise ValueError(f"--cluster {path}: {exc}") from None


def save_cluster(cluster: Cluster, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cluster.to_dict(), indent=1))
    return path


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
    from disagg.runtime.run import SPARE_CPUS

    cpus = [int(n["Resources"].get("CPU", 0)) for n in nodes]
    # as many ranks as cores, and never every logical CPU: the plan's actors
    # holding all of them would leave Ray Data none (see ensure_ray)
    per_node = max(1, min(max(cpus or [1]) - SPARE_CPUS, os.cpu_count() or 1))
    mem = min(int(n["Resources"].get("memory", base.device_memory)) for n in nodes) // per_node
    return replace(base, name="ray(cpu)", devices_per_node=per_node, nodes=len(nodes), device_memory=mem)
