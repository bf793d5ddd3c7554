"""Part 2: the time model's terms measured at the shard shapes of the published layouts, and
the calibration file the planner loads (``disagg plan --calibration FILE``, ``disagg bench
--predict --calibration FILE``) in place of a preset.

Shapes come from the cost model itself (:mod:`disagg.kit.cost.gemms`): Qwen2.5-VL-32B's
vision tower and LLM (:mod:`.real_width`, full width on CUDA) as one rank of each published
split computes them: TP 1/2/4/8 (column and row splits of every linear) and the Ulysses
sequence slices 2/4/8 of the tower. Measured on this device, in the compute dtype (bf16 on
CUDA, float32 on CPU, as the ``cpu`` preset plans):

- every distinct forward matmul ``m x k @ k x n`` (median of a few runs), fitted to the
  efficiency curve (:func:`disagg.plan.calibrate.fit_curve`): ``mfu`` (the ceiling) and
  ``gemm_ridge``;
- ``mem_bw``: an element-wise add streaming 3 tensors;
- ``layer_overhead``: forward + backward of a block too narrow to compute anything
  (:func:`disagg.plan.calibrate.layer_overhead` on the device);
- the attention cores of those layouts (window, full and causal), forward + backward,
  against :func:`disagg.plan.efficiency.attention_efficiency` with the fitted figures.

Printed and reported: predicted ÷ measured per term (each matmul at the fitted curve, each
attention core, the element-wise stream at another size), so a reader sees where the model
is off on this device.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from disagg.gpucheck import real_width
from disagg.gpucheck.device import peak_flops
from disagg.gpucheck.timing import median_seconds
from disagg.interfaces.compute import AttentionCore, Split
from disagg.kit.cost.gemms import decoder_compute, encoder_compute

#: sequence slices and TP splits of the published layouts (8 GPUs)
TP_SPLITS = (1, 2, 4, 8)
ULYSSES = (2, 4, 8)
#: text tokens per sample beside the image (the published prediction's)
TEXT_TOKENS = 512


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def shard_work(cfg: dict[str, Any], n: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``{label: Compute}`` of one rank of each split: the vision tower (``n`` patches) and the
    LLM (``n / 4 + TEXT_TOKENS`` tokens), as the cost model states them."""
    shapes = real_width.shapes(cfg)
    v, d = shapes["vision"], shapes["llm"]
    heads = {"vision": v.heads, "llm": d.kv_heads}
    out: dict[str, Any] = {}
    for tp in TP_SPLITS:
        if heads["vision"] % tp == 0:
            out[f"vision tp{tp}"] = encoder_compute(v, n, Split(tp=tp), 2)
        if heads["llm"] % tp == 0 or d.heads % tp == 0:
            out[f"llm tp{tp}"] = decoder_compute(d, n // v.unit + TEXT_TOKENS, Split(tp=tp), 2)
    for sp in ULYSSES:
        if v.heads % sp == 0:
            out[f"vision ulysses{sp}"] = encoder_compute(v, n, Split(tokens=sp), 2)
    return out, {"vision": v, "llm": d}


def gemm_rate(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype) -> float:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    repeats = 5 if device.type == "cuda" else 2
    return 2.0 * m * n * k / median_seconds(lambda: torch.mm(a, b, out=out), device, repeats)


def stream_bandwidth(numel: int, device: torch.device, dtype: torch.dtype) -> float:
    a, b = torch.randn(numel, device=device, dtype=dtype), torch.randn(numel, device=device, dtype=dtype)
    c = torch.empty_like(a)
    return 3 * dtype.itemsize * numel / median_seconds(lambda: torch.add(a, b, out=c), device)


def layer_overhead(device: torch.device, dtype: torch.dtype, width: int = 16, tokens: int = 8) -> float:
    """Forward + backward of a pre-norm block so narrow its arithmetic is nothing: dispatch and
    launches only (the same block as :func:`disagg.plan.calibrate.layer_overhead`, on the device)."""
    from torch import nn

    mods = nn.ModuleDict(
        {
            "n1": nn.RMSNorm(width),
            "n2": nn.RMSNorm(width),
            "qkv": nn.Linear(width, 3 * width),
            "o": nn.Linear(width, width),
            "g": nn.Linear(width, 2 * width),
            "u": nn.Linear(width, 2 * width),
            "d": nn.Linear(2 * width, width),
        }
    ).to(device=device, dtype=dtype)
    x = torch.randn(1, tokens, width, device=device, dtype=dtype, requires_grad=True)

    def block() -> None:
        h = mods["n1"](x)
        q, k, v = mods["qkv"](h).view(1, tokens, 3, 2, width // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, tokens, width)
        y = x + mods["o"](a)
        z = mods["n2"](y)
        (y + mods["d"](F.silu(mods["g"](z)) * mods["u"](z))).sum().backward()

    return median_seconds(block, device, repeats=7)


def attention_seconds(a: AttentionCore, device: torch.device, dtype: torch.dtype) -> float:
    """Forward + backward of one pass of the core (``count`` 1)."""
    shape = (a.windows, a.heads, a.queries, a.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=a.causal).backward(
            torch.ones(shape, device=device, dtype=dtype)
        )

    return median_seconds(step, device, repeats=3 if device.type == "cuda" else 1)


def run(device: torch.device, out_file: Path) -> dict[str, Any]:
    from disagg.plan.calibrate import fit_curve
    from disagg.plan.cluster import PRESETS, save_cluster
    from disagg.plan.efficiency import attention_efficiency, efficiency

    dtype, e = _dtype(device), _dtype(device).itemsize
    cfg = real_width.config(device)
    n = real_width.TOKENS[device.type]
    work, _ = shard_work(cfg, n)
    gemms = sorted({(g.m, g.n, g.k) for c in work.values() for g in c.gemms})
    samples = [(m, nn, k, gemm_rate(m, nn, k, device, dtype)) for m, nn, k in gemms]
    rate, ridge = fit_curve(samples, e)
    peak = peak_flops(device) if device.type == "cuda" else rate
    base = PRESETS["h200x8" if device.type == "cuda" else "cpu"]
    units = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    cluster = replace(
        base,
        name=f"gpucheck({name})",
        peak_flops=peak,
        mfu=min(1.0, rate / peak),
        gemm_ridge=ridge,
        gemm_tile=128 if device.type == "cuda" else 0,
        compute_units=units,
        mem_bw=stream_bandwidth(1 << (26 if device.type == "cuda" else 20), device, dtype),
        layer_overhead=layer_overhead(device, dtype),
        precision="bf16" if device.type == "cuda" else "fp32",
        source=f"measured by python -m disagg.gpucheck on {name} at the published layouts' shard shapes",
    )
    if device.type == "cuda":
        cluster = replace(cluster, device_memory=torch.cuda.get_device_properties(device).total_memory)
    path = save_cluster(cluster, out_file)

    def ratio_stats(rs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(rs), "min": min(rs), "max": max(rs), "n": len(rs)}

    gemm_ratios = []
    per_gemm = []
    for m, nn, k, r in samples:
        predicted = 2.0 * m * nn * k / (peak * efficiency(m, nn, k, cluster, e))
        measured = 2.0 * m * nn * k / r
        gemm_ratios.append(predicted / measured)
        per_gemm.append(
            {"m": m, "n": nn, "k": k, "tflops": r / 1e12, "predicted_over_measured": predicted / measured}
        )
    attn = {}
    for label, c in work.items():
        for a in c.attention:
            one = replace(a, count=1)
            key = f"{label} q{a.queries} w{a.windows} h{a.heads}{' causal' if a.causal else ''}"
            if key in attn:
                continue
            measured = attention_seconds(one, device, dtype)
            # forward + backward of one pass: the model's 3 passes (TRAIN_PASSES) of its FLOPs
            predicted = 3 * one.flops / (peak * attention_efficiency(one, cluster, e))
            attn[key] = {"measured_s": measured, "predicted_over_measured": predicted / measured}
    # the element-wise stream at a size other than the fit's: an RMSNorm-sized add
    numel = n * cfg["vision_config"]["hidden_size"]
    ew_measured = 3 * e * numel / stream_bandwidth(numel, device, dtype)
    ew_pred = 3 * e * numel / cluster.mem_bw
    terms = {
        "gemm": ratio_stats(gemm_ratios),
        "attention": ratio_stats([a["predicted_over_measured"] for a in attn.values()]),
        "elementwise": {"median": ew_pred / ew_measured, "n": 1},
        "layer_overhead_s": cluster.layer_overhead,
    }
    return {
        "file": str(path),
        "cluster": cluster.to_dict(),
        "tokens": n,
        "splits": sorted(work),
        "predicted_over_measured": terms,
        "gemms": per_gemm,
        "attention": attn,
        "ok": path.is_file() and all(x["predicted_over_measured"] > 0 for x in per_gemm) and bool(attn),
    }
