"""ulysses under core's bf16 rule (``compute_dtype``: fp32 parameters,
gradients and optimizer state; the forward autocast to bf16 on the CPU): a step
runs, its output and gradient norm are close to fp32's, parameters stay fp32."""

from __future__ import annotations

import math

import pytest
import torch
from ulysses_cases import bf16_rank, loads

from disagg.testing.dist import run_ranks
from disagg_vision_sp.families.llava import LlavaVision
from disagg_vision_sp.testing import random_images, upstream_grads

SAMPLES = [[(50, 40), (20, 30)], [(64, 64)]]


def test_bf16_step_close_to_fp32(tiny_llava):
    family = LlavaVision(tiny_llava)
    inputs = [family.preprocess(random_images(s, seed=i)) for i, s in enumerate(SAMPLES)]
    grads = upstream_grads(family, inputs)
    outs = [loads(r) for r in run_ranks(bf16_rank, 2, 2, str(tiny_llava), inputs, grads)]
    fp32 = sum(o["fp32"]["dot"] for o in outs)
    bf16 = sum(o["bf16"]["dot"] for o in outs)
    assert math.isfinite(bf16) and bf16 != fp32, "the forward must really run in bf16"
    scale = sum(float(g.abs().sum()) for g in grads) * 1e-2  # loose: bf16 keeps ~3 digits
    assert abs(bf16 - fp32) <= scale
    for res in outs:
        b, f = res["bf16"], res["fp32"]
        assert b["out_dtypes"] == {torch.bfloat16}
        assert math.isfinite(b["norm_sq"]) and b["norm_sq"] == pytest.approx(f["norm_sq"], rel=1e-1)
        for key in ("param_dtypes", "grad_dtypes", "state_dtypes"):
            assert b[key] == {torch.float32}, key
        for n, p in f["params"].items():
            # one AdamW step (lr 1e-3) moves an element by about lr at most
            assert b["params"][n].dtype == torch.float32
            assert float((b["params"][n] - p).abs().max()) <= 2.5e-3, n
