"""Measure this machine's figures for the planner's time model (``disagg plan
--calibrate``, the ``cpu-local`` preset), instead of looking them up.

Short microbenchmarks, a few seconds in all, each the smallest honest probe of
one term of :mod:`disagg.plan.model`:

- the efficiency curve (:mod:`disagg.plan.efficiency`): float32 matmuls of a sweep
  of shapes (:data:`GEMM_SWEEP`, square to narrow: arithmetic intensity 4-128 FLOP/B)
  on one thread (a Ray actor's torch runs one thread per CPU it holds,
  ``OMP_NUM_THREADS``), fitted to ``rate(I) = R · min(1, I / ridge)``
  (:func:`fit_curve`): ``peak_flops = R`` and ``mfu`` 1 (the measured rate already
  being what a well-shaped matmul reaches), ``gemm_ridge = ridge``; no tile or wave
  quantization on a core;
- ``mem_bw``: an element-wise add of 4M floats (``c = a + b``, 3 x 16 MiB moved);
- ``layer_overhead``: forward + backward of a transformer block so narrow that
  its arithmetic is negligible: what every layer pays per microbatch in
  dispatch (eager ops, autograd), whatever its size.
- ``intra_latency`` / ``intra_bw``: two processes, ``torch.distributed`` over
  gloo, the collective backend the CPU runs use: a 4-byte all-reduce (2 ring
  steps, ``t = 2α``) and a 4 MiB one (``t = 2α + b/bw``, each rank sending ``b``).
- ``call_latency``: the round trip of a Ray actor call carrying a small tensor,
  when Ray is already running or ``ray_calls`` asks for it (starting Ray takes
  seconds); else the preset's figure stays.

Medians over repeats, so a busy machine's outliers weigh less; the figures
still move with load (report the load beside them).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import replace
from typing import Any, Callable

from disagg.plan.cluster import Cluster


def _median_time(fn: Callable[[], Any], repeats: int, inner: int = 1) -> float:
    fn()  # warm-up: allocations, lazy initialisation
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def matmul_flops(n: int = 384, repeats: int = 7) -> float:
    """FLOP/s of an ``n x n x n`` float32 matmul on one thread (``2n³`` FLOPs)."""
    return gemm_rate(n, n, n, repeats)


def gemm_rate(m: int, n: int, k: int, repeats: int = 5) -> float:
    """FLOP/s of an ``m x k`` by ``k x n`` float32 matmul on one thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(m, k), torch.randn(k, n)
        out = torch.empty(m, n)
        return 2 * m * n * k / _median_time(lambda: torch.mm(a, b, out=out), repeats, inner=3)
    finally:
        torch.set_num_threads(threads)


#: (m, n, k) the calibration times: large and square down to the narrow products a
#: tensor-parallel split or a few heads leave (~0.1-0.3 GFLOP each, ~2 s in all on one core)
GEMM_SWEEP: tuple[tuple[int, int, int], ...] = (
    (384, 384, 384),
    (512, 512, 512),
    (1024, 512, 256),
    (2048, 512, 64),
    (2048, 64, 512),
    (4096, 256, 32),
    (4096, 32, 256),
    (8192, 128, 16),
    (8192, 16, 128),
)


def gemm_sweep(shapes: tuple[tuple[int, int, int], ...] = GEMM_SWEEP) -> list[tuple[int, int, int, float]]:
    """``(m, n, k, FLOP/s)`` of every shape."""
    return [(m, n, k, gemm_rate(m, n, k)) for m, n, k in shapes]


def fit_curve(samples: list[tuple[int, int, int, float]], elem_bytes: int = 4) -> tuple[float, float]:
    """``(R, ridge)`` of ``rate(I) = R · min(1, I / ridge)`` fitted to measured
    ``(m, n, k, rate)`` by least squares on ``log rate``. Sorted by intensity, the
    products below the ridge are memory-bound (``log rate = log I + b``), the rest
    compute-bound (``log rate = log R``): each split of the sorted list gives ``log R``
    and ``b`` as means, ``ridge = R / e^b`` (kept between the split's two intensities);
    the split with the least squared error wins. ``ridge`` 0: no product was memory-bound."""
    from disagg.plan.efficiency import intensity

    pts = sorted((intensity(m, n, k, elem_bytes), math.log(r)) for m, n, k, r in samples if r > 0)
    if not pts:
        raise ValueError("fit_curve: no measurement")
    best: tuple[float, float, float] | None = None
    for j in range(len(pts)):  # pts[:j] memory-bound, pts[j:] compute-bound (at least one)
        log_r = sum(y for _, y in pts[j:]) / (len(pts) - j)
        ridge = 0.0
        if j:
            b = sum(y - math.log(i) for i, y in pts[:j]) / j
            ridge = min(max(math.exp(log_r - b), pts[j - 1][0]), pts[j][0])
        err = sum((y - log_r - (min(0.0, math.log(i / ridge)) if ridge else 0.0)) ** 2 for i, y in pts)
        if best is None or err < best[0] - 1e-12 * (1 + best[0]):
            best = (err, math.exp(log_r), ridge)
    assert best is not None
    return best[1], best[2]


def stream_bandwidth(numel: int = 1 << 22, repeats: int = 7) -> float:
    """Bytes/s an element-wise float32 add moves on one thread (two reads, one write)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
        return 3 * 4 * numel / _median_time(lambda: torch.add(a, b, out=c), repeats, inner=3)
    finally:
        torch.set_num_threads(threads)


def layer_overhead(width: int = 16, tokens: int = 8, repeats: int = 7) -> float:
    """Seconds of one forward + backward of a tiny pre-norm transformer block
    (norm, qkv, attention, output, norm, gated MLP): its fixed cost per call."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        norm1, norm2 = nn.RMSNorm(width), nn.RMSNorm(width)
        qkv, out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        gate, up, down = nn.Linear(width, 2 * width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        x = torch.randn(1, tokens, width, requires_grad=True)
        heads = 2

        def block() -> None:
            h = norm1(x)
            q, k, v = qkv(h).view(1, tokens, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, tokens, width)
            y = x + out(a)
            z = norm2(y)
            y = y + down(F.silu(gate(z)) * up(z))
            y.sum().backward()

        return _median_time(block, repeats, inner=5)
    finally:
        torch.set_num_threads(threads)


def _gloo_worker(rank: int, world: int, path: str, sizes: tuple[int, ...], iters: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        out = []
        for numel in sizes:
            t = torch.ones(numel)
            out.append(_median_time(lambda t=t: dist.all_reduce(t), iters, inner=5))
        if rank == 0:
            queue.put(out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def gloo_alpha_beta(small: int = 1, large: int = 1 << 20, iters: int = 7) -> tuple[float, float]:
    """(α seconds per ring step, bytes/s per rank) of a gloo all-reduce between two
    local processes: ``t(4 B) = 2α``, ``t(b) = 2α + b/bw`` (ring over 2 ranks: each
    sends ``2(p-1)b/p = b``)."""
    import multiprocessing as mp
    import tempfile

    # fork is fast (torch already imported); a process running Ray's threads spawns
    # instead, as forking one could inherit a lock another thread holds
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() and not _ray_running() else "spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_gloo_worker, args=(r, 2, path, (small, large), iters, queue))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        try:
            t_small, t_large = queue.get(timeout=120)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
    alpha = t_small / 2
    nbytes = 4 * large
    return alpha, nbytes / max(t_large - t_small, 1e-9)


def _ray_running() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return bool(ray.is_initialized())


def ray_call_latency(calls: int = 50) -> float:
    """Seconds per round trip of a Ray actor call carrying a small tensor and
    returning one (what the orchestrator does per microbatch and rank)."""
    import ray
    import torch

    @ray.remote(num_cpus=0)
    class Echo:
        def echo(self, x: Any) -> Any:
            return x

    actor = Echo.remote()  # type: ignore[attr-defined]
    x = torch.zeros(64)
    try:
        return _median_time(lambda: ray.get(actor.echo.remote(x)), 5, inner=max(1, calls // 5))
    finally:
        ray.kill(actor)


def calibrate(base: Cluster, *, name: str | None = None, ray_calls: bool | None = None) -> Cluster:
    """``base`` with this machine's measured rates and latencies (see the module doc).
    ``ray_calls``: measure the actor call round trip (default: when Ray is running)."""
    flops, ridge = fit_curve(gemm_sweep())
    overhead = layer_overhead()
    alpha, bw = gloo_alpha_beta()
    mem_bw = stream_bandwidth()
    call = base.call_latency
    measured = ["matmul", "layer", "gloo", "gemm curve", "memory"]
    if ray_calls is None:
        ray_calls = _ray_running()
    if ray_calls:
        call = ray_call_latency()
        measured.append("ray call")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return replace(
        base,
        name=name or f"{base.name}(measured)",
        devices_per_node=os.cpu_count() or base.devices_per_node,
        peak_flops=flops,
        mfu=1.0,
        intra_bw=bw,
        inter_bw=min(bw, base.inter_bw) if base.nodes > 1 else bw,
        intra_latency=alpha,
        inter_latency=max(alpha, base.inter_latency) if base.nodes > 1 else alpha,
        layer_overhead=overhead,
        call_latency=call,
        gemm_ridge=ridge,
        gemm_tile=0,
        compute_units=0,
        mem_bw=mem_bw,
        source=f"measured ({', '.join(measured)}) at load {load:.2f}",
    )
