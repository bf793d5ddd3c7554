"""megatron_tp under core's bf16 rule (``compute_dtype``: fp32 parameters,
gradients and optimizer state; the forward autocast to bf16 on the CPU): a step
runs, its loss and gradients are close to fp32's, parameters stay fp32."""

from __future__ import annotations

import math

import pytest
import torch
from dropout_cases import tp_bf16_rank
from tp_cases import _loads, make_batch, rel

from disagg.testing.dist import run_ranks
from disagg_llm_tp.families.qwen2 import Qwen2Family


def test_bf16_step_close_to_fp32(tiny_dirs):
    path = tiny_dirs["qwen2"]
    samples, embeds = make_batch(Qwen2Family(path), n_samples=4)
    outs = [_loads(b) for b in run_ranks(tp_bf16_rank, 2, path, 2, samples, embeds)]
    for res in outs:
        fp32, bf16 = res["fp32"], res["bf16"]
        assert math.isfinite(bf16["loss"]) and math.isfinite(bf16["norm_sq"])
        assert bf16["loss"] == pytest.approx(fp32["loss"], rel=2e-2)
        assert bf16["norm_sq"] == pytest.approx(fp32["norm_sq"], rel=1e-1)
        for key in ("param_dtypes", "grad_dtypes", "state_dtypes"):
            assert bf16[key] == {torch.float32}, key
        for a, b in zip(bf16["embed_grads"], fp32["embed_grads"]):
            for k in b:
                assert a[k].dtype == torch.float32 and rel(a[k], b[k]) <= 5e-2
        assert bf16["loss"] != fp32["loss"], "the forward must really run in bf16"
        # One AdamW step (lr 1e-3) moves an element by about lr whatever its gradient's
        # size, so near-zero gradients (a key bias) may flip sign: bound the difference
        # by the step, and the whole model's relative difference.
        assert all(p.dtype == torch.float32 for p in bf16["params"].values())
        for n, p in fp32["params"].items():
            assert float((bf16["params"][n] - p).abs().max()) <= 2.5e-3, n
        flat = [torch.cat([d[n].flatten() for n in fp32["params"]]) for d in (bf16["params"], fp32["params"])]
        assert rel(*flat) <= 1e-2
