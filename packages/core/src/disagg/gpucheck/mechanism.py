"""Part 4: the paper's mechanism. A Qwen2.5-VL-32B vision block's work on one rank of a
degree-``d`` layout, in the shapes each strategy gives it, timed on this device (bf16 weights
and activations, no autocast, forward + backward):

- ``ulysses``: the linears, norms and element-wise work of ``n / d`` tokens at full width;
  attention over all ``n`` tokens with ``heads / d`` heads (after the all-to-all);
- ``tp``: every linear split ``d`` ways (qkv and the MLP's gate/up by output columns, proj and
  down by input rows) over all ``n`` tokens, norms and element-wise work on all ``n`` tokens
  (replicated, as TP without sequence parallelism runs them); attention ``heads / d`` heads.

Both do the same matmul FLOPs per rank; the difference is the shapes (a 1280-wide tower split 8
ways leaves 160-wide products) and TP's replicated element-wise work: the reason a narrow tower
loses under TP. Collectives are not in it (one device). Window blocks attend within windows of
``window_tokens``; the tower is ``depth - full`` of those and ``full`` full-attention blocks.

With them, each strategy's MFU from part 1 (the model's FLOPs per step over its measured step
time and the device's bf16 peak, in the runtime's recipe).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from disagg.gpucheck import real_width
from disagg.gpucheck.device import peak_flops
from disagg.gpucheck.timing import median_seconds

DTYPE = torch.bfloat16


def _block_fn(n_lin: int, n_attn: int, h: int, i: int, heads: int, hd: int, tp: int, window: int, device):
    """Forward + backward of one block's work on one rank (see module doc)."""
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device, dtype=DTYPE) * 0.02).requires_grad_(True)

    qkv, proj = w(3 * h // tp, h), w(h, h // tp)
    gate, up, down = w(i // tp, h), w(i // tp, h), w(h, i // tp)
    norm1, norm2 = w(h), w(h)
    x = torch.randn(n_lin, h, generator=g, device=device, dtype=DTYPE).requires_grad_(True)
    local_heads = heads // tp if tp > 1 else heads // (n_attn // n_lin)

    def step() -> None:
        a = F.rms_norm(x, (h,), norm1)
        q, k, v = F.linear(a, qkv).view(n_lin, 3, -1, hd).unbind(1)
        # the attention the rank runs: all n tokens, its heads (ulysses: after the all-to-all,
        # whose data movement is stood in for by a repeat of its own rows)
        reps = n_attn // n_lin

        def spread(t: torch.Tensor) -> torch.Tensor:
            t = t.repeat(reps, 1, 1)[:, :local_heads] if reps > 1 else t
            if window:
                return t.view(n_attn // window, window, local_heads, hd).transpose(1, 2)
            return t.view(1, n_attn, local_heads, hd).transpose(1, 2)

        o = F.scaled_dot_product_attention(spread(q), spread(k), spread(v))
        o = o.transpose(1, 2).reshape(n_attn, local_heads * hd)
        if reps > 1:  # back to this rank's tokens, all heads
            o = o.view(reps, n_lin, local_heads * hd).transpose(0, 1).reshape(n_lin, -1)
        y = x + F.linear(o, proj)
        z = F.rms_norm(y, (h,), norm2)
        y = y + F.linear(F.silu(F.linear(z, gate)) * F.linear(z, up), down)
        y.backward(torch.ones_like(y))
        for t in (x, qkv, proj, gate, up, down, norm1, norm2):
            t.grad = None

    return step


def tower_seconds(cfg: dict, n: int, degree: int, layout: str, device: torch.device) -> dict[str, float]:
    v = cfg["vision_config"]
    h, i, heads = v["hidden_size"], v["intermediate_size"], v["num_heads"]
    hd = h // heads
    full = len(v["fullatt_block_indexes"])
    depth = v["depth"]
    window = (v["window_size"] // v["patch_size"]) ** 2
    n_lin, tp = (n // degree, 1) if layout == "ulysses" else (n, degree)
    out = {}
    for kind, win in (("window_block_s", window), ("full_block_s", 0)):
        out[kind] = median_seconds(_block_fn(n_lin, n, h, i, heads, hd, tp, win, device), device)
    out["tower_s"] = (depth - full) * out["window_block_s"] + full * out["full_block_s"]
    return out


def run(device: torch.device, correctness: dict[str, Any] | None) -> dict[str, Any]:
    cfg = real_width.config(device)
    n = real_width.TOKENS[device.type]
    degree = min(8, cfg["vision_config"]["num_heads"])
    out: dict[str, Any] = {"tokens": n, "degree": degree, "dtype": "bfloat16", "autocast": False}
    shapes = real_width.shapes(cfg)
    from disagg.kit.cost.rules import encoder_flops

    # per rank: the tower's training FLOPs over the degree (the same for both layouts)
    flops = encoder_flops(shapes["vision"], n) / degree
    for layout in ("ulysses", "tp"):
        t = tower_seconds(cfg, n, degree, layout, device)
        t["tokens_per_s"] = n / t["tower_s"]
        t["mfu"] = flops / t["tower_s"] / peak_flops(device)
        out[layout] = t
    out["ulysses_over_tp_throughput"] = out["ulysses"]["tokens_per_s"] / out["tp"]["tokens_per_s"]
    out["strategy_mfu"] = {
        name: rec.get("mfu") for name, rec in ((correctness or {}).get("layouts") or {}).items()
    }
    out["ok"] = (
        all(out[k]["tower_s"] > 0 for k in ("ulysses", "tp"))
        and bool(out["strategy_mfu"])
        and all(m is not None and m > 0 for m in out["strategy_mfu"].values())
    )
    return out
