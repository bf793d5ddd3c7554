"""Compute time by shape: the efficiency a matmul reaches on a machine, as a function
of its shape (the curve :func:`efficiency`), applied to what a strategy states a rank
computes (:class:`disagg.interfaces.compute.Compute`).

The form is the roofline with tile and wave quantization of NVIDIA's *Matrix
Multiplication Background User's Guide* (docs.nvidia.com/deeplearning/performance/
dl-performance-matrix-multiplication): a product of ``m x k`` by ``k x n`` at ``e``
bytes per element has arithmetic intensity ``I = 2mnk / (e(mk + kn + mn))`` FLOPs per
byte of its operands and output, and reaches

    eff = ceiling · min(1, I / ridge) · q_tile   (· q_wave, attention cores)

of the device's peak, where

- ``ceiling`` (``Cluster.mfu``) is what the largest, best-shaped matmuls reach;
- ``ridge`` (``Cluster.gemm_ridge``, FLOPs per byte) is where the memory time of its
  operands equals its arithmetic time at the ceiling (``ceiling · peak / bandwidth``):
  below it a matmul is bound by memory, and its efficiency falls linearly with ``I``;
- ``q_tile = mn / (⌈m/T⌉T · ⌈n/T⌉T)``: the output is computed in ``T x T`` tiles
  (``Cluster.gemm_tile``), a partly filled tile costs a whole one (a TP-split width of
  432 columns runs in 512);
- ``q_wave = t / (U⌈t/U⌉)`` for ``t`` tiles on ``U`` compute units (``Cluster.compute_units``,
  SMs): the last wave runs partly empty. Charged to attention cores only, whose grid is one
  block of ``T`` queries per head and window (FlashAttention-2): few heads per rank and
  short sequences leave units idle. Matmuls are not charged it: cuBLAS on Hopper balances
  a product's tiles over the units (stream-K) rather than running whole waves.

Monotone non-decreasing in ``I`` and bounded by ``ceiling``; ``T = 0`` / ``U = 0`` (a CPU)
drop the quantization, ``ridge = 0`` the memory bound. A fused attention core
(FlashAttention: queries, keys, values and output move once, the scores stay on chip)
has ``I = flops / (e·hd·(2q + 2k))`` per head and window, its tiles are blocks of
``T`` queries per head and window, and its head dim is padded to the kernel's
(:data:`HEAD_DIM_STEP`: ``hd = 80`` runs at 80/96). Element-wise work is bound by memory: its bytes at
``Cluster.mem_bw``. A :class:`Cost` that states no shapes (``compute`` None) is charged
its FLOPs at the ceiling, and a cluster with no curve (:func:`flat`) charges every FLOP
at ``mfu``, the planner's model before shapes were counted.

Training's backward products have the forward's three dimensions permuted: the same
``I``; their tiles are counted as the forward's (an approximation).
"""

from __future__ import annotations

import math
from dataclasses import replace

from disagg.interfaces.compute import AttentionCore, Compute, Gemm
from disagg.interfaces.cost import Cost
from disagg.plan.cluster import Cluster

#: FlashAttention-2 compiles its kernels for head dims 32, 64, 96, 128, ... and runs a head of
#: another size in the next one up (80 in the 96 kernel)
HEAD_DIM_STEP = 32
#: the fields that carry the curve; all 0 = every FLOP at ``mfu`` (:func:`flat`)
CURVE_FIELDS = ("gemm_ridge", "gemm_tile", "compute_units", "mem_bw")


def shaped(cluster: Cluster) -> bool:
    """Whether ``cluster`` charges compute by shape (any curve field set)."""
    return any(getattr(cluster, f) for f in CURVE_FIELDS)


def flat(cluster: Cluster, mfu: float | None = None) -> Cluster:
    """``cluster`` without the curve: every FLOP at ``mfu`` (default: its own), no element-wise term."""
    return replace(cluster, mfu=cluster.mfu if mfu is None else mfu, **{f: 0 for f in CURVE_FIELDS})


def intensity(m: int, n: int, k: int, elem_bytes: int) -> float:
    """FLOPs per byte of a product's operands and output, each moved once."""
    return 2.0 * m * n * k / (elem_bytes * (m * k + k * n + m * n))


def _waves(tiles: int, cluster: Cluster) -> float:
    u = cluster.compute_units
    return tiles / (u * math.ceil(tiles / u)) if u > 0 else 1.0


def _tile(rows: int, cols: int, cluster: Cluster) -> float:
    """``q_tile`` of a ``rows x cols`` output in ``T x T`` tiles."""
    t = cluster.gemm_tile
    if t <= 0:
        return 1.0
    return rows * cols / (math.ceil(rows / t) * t * math.ceil(cols / t) * t)


def _roofline(i: float, cluster: Cluster) -> float:
    ridge = cluster.gemm_ridge
    return cluster.mfu * (min(1.0, i / ridge) if ridge > 0 else 1.0)


def efficiency(m: int, n: int, k: int, cluster: Cluster, elem_bytes: int = 2) -> float:
    """Fraction of ``cluster.peak_flops`` an ``m x k`` by ``k x n`` product reaches (module docstring)."""
    return _roofline(intensity(m, n, k, elem_bytes), cluster) * _tile(m, n, cluster)


def attention_efficiency(a: AttentionCore, cluster: Cluster, elem_bytes: int = 2) -> float:
    """Fraction of the peak a fused attention core reaches: its intensity per head and window;
    on a GPU (``gemm_tile`` set) blocks of ``T`` queries, one per head and window, in waves over
    the units, and the head dim padded to the kernel's (a multiple of :data:`HEAD_DIM_STEP`)."""
    per = a.flops / (a.count * a.heads * a.windows)
    i = per / (elem_bytes * a.head_dim * (2 * a.queries + 2 * a.keys))
    t = cluster.gemm_tile
    if t <= 0:
        return _roofline(i, cluster) * _waves(a.heads * a.windows, cluster)
    blocks = math.ceil(a.queries / t)
    q = a.queries / (blocks * t) * a.head_dim / (math.ceil(a.head_dim / HEAD_DIM_STEP) * HEAD_DIM_STEP)
    return _roofline(i, cluster) * q * _waves(a.heads * a.windows * blocks, cluster)


def gemm_seconds(g: Gemm, cluster: Cluster, elem_bytes: int) -> float:
    return g.flops / (cluster.peak_flops * efficiency(g.m, g.n, g.k, cluster, elem_bytes))


def compute_seconds(cost: Cost, cluster: Cluster) -> float:
    """Seconds a rank computes per step: each matmul and attention core at its shape's
    efficiency, element-wise bytes at ``mem_bw``; FLOPs at ``mfu`` where the cost states
    no shapes or the cluster has no curve."""
    rate = cluster.peak_flops * cluster.mfu
    if cost.compute is None or not shaped(cluster):
        return cost.flops / rate
    return work_seconds(cost.compute, cluster)


def work_seconds(c: Compute, cluster: Cluster) -> float:
    """:func:`compute_seconds` of one :class:`Compute`."""
    e = c.elem_bytes
    dense = sum(gemm_seconds(g, cluster, e) for g in c.gemms)
    attn = sum(a.flops / (cluster.peak_flops * attention_efficiency(a, cluster, e)) for a in c.attention)
    ew = c.elementwise_bytes / cluster.mem_bw if cluster.mem_bw > 0 else 0.0
    return dense + attn + ew
