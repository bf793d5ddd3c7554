"""Qwen2.5-VL vision tower: HF's per-window attention loop vs the ulysses path's
one varlen call per block, same weights, same image, timed in one run.

Three paths over one random-weight tower:

- ``hf``: Hugging Face's own ``sdpa`` implementation (without flash-attn
  installed, HF loops over the windows: one attention call and a host sync each);
- ``ulysses_loop``: the ulysses attention as it was registered before (a name
  without "flash": HF's per-window loop calls it once per window);
- ``ulysses_varlen``: the ulysses attention as registered now
  (``disagg_ulysses_flash``: one varlen call per block, one batched sdpa call
  per distinct window length).

Outputs of the three are compared (they are the same math), then each is timed
(forward, and forward + backward) alternately, ``--repeat`` times; medians and
ratios are printed, and written as JSON with ``--json``. FLOPs count linear
layers (2 per multiply-add) and attention within windows / whole images, so
``--peak-tflops`` gives MFU.

    python examples/bench/vision_attention.py --tokens 4096            # CPU, small width
    python examples/bench/vision_attention.py --width 7b --tokens 9216 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Any

import torch

#: Qwen2.5-VL-7B's vision tower, and a small one of the same structure for CPU runs
WIDTHS = {
    "7b": dict(
        depth=32,
        hidden_size=1280,
        num_heads=16,
        intermediate_size=3420,
        out_hidden_size=3584,
        fullatt_block_indexes=[7, 15, 23, 31],
    ),
    "small": dict(
        depth=8,
        hidden_size=256,
        num_heads=4,
        intermediate_size=512,
        out_hidden_size=512,
        fullatt_block_indexes=[3, 7],
    ),
}
OLD_NAME = "disagg_ulysses"  # the registration before: no "flash", so HF loops over windows


def build(width: str, device: str, seed: int = 0) -> torch.nn.Module:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg = Qwen2_5_VLVisionConfig(**WIDTHS[width], patch_size=14, window_size=112, spatial_merge_size=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen2_5_VisionTransformerPretrainedModel(cfg).to(device).train()


def image(tokens: int, device: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A square patch grid of ``tokens`` patches (side a multiple of the 8-patch window)."""
    side = int(math.isqrt(tokens))
    if side * side != tokens or side % 8:
        raise SystemExit(f"--tokens {tokens}: use a square of a multiple of 8 (e.g. 4096 = 64², 9216 = 96²)")
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(tokens, 3 * 2 * 14 * 14, generator=g).to(device)
    return pixels, torch.tensor([[1, side, side]], device=device)


def flops(model: torch.nn.Module, tokens: int) -> float:
    """Forward FLOPs: 2 per multiply-add of every block and merger weight, attention
    ``4·n·L·h`` per block (window blocks ``L`` = window tokens, full blocks ``L = n``)."""
    cfg = model.config
    h = cfg.hidden_size
    weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "patch_embed" not in n)
    window = (cfg.window_size // cfg.patch_size) ** 2
    attn = sum(
        4 * tokens * (tokens if i in cfg.fullatt_block_indexes else window) * h for i in range(cfg.depth)
    )
    return 2.0 * weights * tokens + attn


def run(
    model: torch.nn.Module,
    impl: str,
    pixels: torch.Tensor,
    grid: torch.Tensor,
    dtype: torch.dtype,
    backward: bool,
) -> torch.Tensor:
    from disagg.interfaces.comm import CommCounter
    from disagg_vision_sp.ulysses.attention import UlyssesRuntime

    model.config._attn_implementation = impl
    for block in model.blocks:
        block.attn.config._attn_implementation = impl
    rt = UlyssesRuntime(
        base="sdpa", group=None, degree=1, shard=0, sizes=[pixels.shape[0]], comm=CommCounter()
    )
    with rt.active(), torch.autocast(pixels.device.type, dtype=dtype, enabled=dtype != torch.float32):
        out = model(pixels, grid_thw=grid)
        out = out.pooler_output if hasattr(out, "pooler_output") else out
    if backward:
        out.float().square().mean().backward()
    return out.detach()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(width: str, tokens: int, device: str, dtype_name: str, repeat: int) -> dict[str, Any]:
    from transformers import AttentionInterface

    from disagg_vision_sp.ulysses import attention

    attention.register()
    AttentionInterface.register(OLD_NAME, attention.ulysses_attention_forward)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    model = build(width, device)
    pixels, grid = image(tokens, device)
    paths = {"hf": "sdpa", "ulysses_loop": OLD_NAME, "ulysses_varlen": attention.ATTN_NAME}
    with torch.no_grad():
        outs = {name: run(model, impl, pixels, grid, dtype, False) for name, impl in paths.items()}
    ref = outs["hf"].float()
    diff = {n: float((o.float() - ref).abs().max() / ref.abs().max()) for n, o in outs.items()}
    times: dict[str, dict[str, list[float]]] = {n: {"forward": [], "forward_backward": []} for n in paths}
    for _ in range(repeat):
        for name, impl in paths.items():  # alternate: the machine's load falls on every path alike
            for kind, backward in (("forward", False), ("forward_backward", True)):
                model.zero_grad(set_to_none=True)
                sync(device)
                t0 = time.perf_counter()
                with torch.set_grad_enabled(backward):
                    run(model, impl, pixels, grid, dtype, backward)
                sync(device)
                times[name][kind].append(time.perf_counter() - t0)
    fwd = flops(model, tokens)
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    return {
        "width": width,
        "tokens": tokens,
        "device": device,
        "dtype": dtype_name,
        "repeat": repeat,
        "forward_flops": fwd,
        "max_rel_diff_vs_hf": diff,
        "median_s": med,
        "ratio_loop_over_varlen": {k: med["ulysses_loop"][k] / med["ulysses_varlen"][k] for k in med["hf"]},
        "ratio_hf_over_varlen": {k: med["hf"][k] / med["ulysses_varlen"][k] for k in med["hf"]},
        "tflops_per_s": {
            n: {
                "forward": fwd / m["forward"] / 1e12,
                "forward_backward": 3 * fwd / m["forward_backward"] / 1e12,
            }
            for n, m in med.items()
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", choices=sorted(WIDTHS), default="small")
    ap.add_argument("--tokens", type=int, default=4096, help="patches of the one image (a square grid)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak, for MFU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = measure(args.width, args.tokens, args.device, args.dtype, args.repeat)
    if args.peak_tflops:
        res["mfu"] = {
            n: {k: v / args.peak_tflops for k, v in t.items()} for n, t in res["tflops_per_s"].items()
        }
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
