"""Part 3: memory at real width. One vision block and one LLM layer of Qwen2.5-VL-32B
(:mod:`.real_width`) at a long sequence, forward + backward under ``recompute: full``
(``torch.utils.checkpoint``: the block keeps only its input, and replays its forward in
backward) in bf16 weights and activations, no autocast (the runtime's recipe).

Measured: ``torch.cuda.max_memory_allocated`` during the forward + backward, less what was
allocated before it (weights, the input, the upstream gradient) and less the weight
gradients (their bytes are exact: one per weight element): the bytes the replayed block holds
at its peak. Predicted: the cost model's saved bytes of one block for the same tokens
(:func:`~disagg.kit.cost.rules.block_elems` per token in the compute dtype, plus what HF's
code keeps in float32, :func:`~disagg.kit.cost.rules.fp32_internal_bytes`), the term a
layout's activation memory under ``full`` recompute is made of. The ratio measured ÷ predicted
says how far the per-layer count is from the allocator (transients of the backward, the
attention kernel's workspace are not in the count). On CPU there is no allocator peak to read:
the measurement is reported as not available, the prediction still computed.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

from disagg.gpucheck import real_width
from disagg.kit.cost.rules import block_elems, fp32_internal_bytes, one_block

DTYPE = torch.bfloat16


def _measure(
    module: torch.nn.Module, make_inputs: Callable[[], tuple[torch.Tensor, dict]], device: torch.device
) -> dict[str, Any]:
    x, kwargs = make_inputs()
    x.requires_grad_(True)
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # the output's upstream gradient: allocated before the measurement like the input
        upstream = torch.randn_like(x)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        upstream = torch.randn_like(x)
    out = checkpoint(module, x, use_reentrant=False, **kwargs)
    out.backward(upstream)
    if device.type != "cuda":
        return {"measured_bytes": None, "measured": "not available on cpu (no allocator peak to read)"}
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    return {
        "measured_bytes": int(peak - grad_bytes),
        "peak_above_state_bytes": int(peak),
        "weight_grad_bytes": grad_bytes,
    }


def run(device: torch.device) -> dict[str, Any]:
    cfg = real_width.config(device)
    shapes = real_width.shapes(cfg)
    n = real_width.TOKENS[device.type]
    e = DTYPE.itemsize
    out: dict[str, Any] = {
        "tokens": n,
        "dtype": "bfloat16",
        "recompute": "full",
        "width": "full" if device.type == "cuda" else f"1/{real_width.CPU_SCALE}",
    }

    vshape = shapes["vision"]
    block = real_width.vision_block(cfg, device, DTYPE)
    cos, sin = real_width.vision_rotary(cfg, n, device)

    def vision_inputs() -> tuple[torch.Tensor, dict]:
        x = torch.randn(n, vshape.hidden, device=device, dtype=DTYPE)
        cu = torch.tensor([0, n], dtype=torch.int32, device=device)  # a full-attention block
        return x, {"cu_seqlens": cu, "position_embeddings": (cos, sin)}

    one = one_block(vshape)
    v_pred = n * block_elems(vshape) * e + fp32_internal_bytes(one, n, n, e)
    out["vision_block"] = {"predicted_bytes": int(v_pred), **_measure(block, vision_inputs, device)}
    del block

    dshape = shapes["llm"]
    layer, rotary = real_width.llm_layer(cfg, device, DTYPE)

    def llm_inputs() -> tuple[torch.Tensor, dict]:
        x = torch.randn(1, n, dshape.hidden, device=device, dtype=DTYPE)
        pos = torch.arange(n, device=device)[None]
        return x, {"position_embeddings": rotary(x, pos)}

    d_pred = n * block_elems(dshape) * e + fp32_internal_bytes(one_block(dshape), n, 0, e)
    out["llm_layer"] = {"predicted_bytes": int(d_pred), **_measure(layer, llm_inputs, device)}
    del layer
    for part in ("vision_block", "llm_layer"):
        rec = out[part]
        m = rec.get("measured_bytes")
        rec["measured_over_predicted"] = m / rec["predicted_bytes"] if m is not None else None
    if device.type == "cuda":
        # a figure that is missing or not positive is a failed measurement, never a pass
        out["ok"] = all((out[p]["measured_bytes"] or 0) > 0 for p in ("vision_block", "llm_layer"))
    else:
        out["ok"] = all(out[p]["predicted_bytes"] > 0 for p in ("vision_block", "llm_layer"))
    return out
