"""megatron_tp under core's bf16 rule (``compute_dtype``: fp32 parameters,
gradients and optimizer state; the forward autocast to bf16 on the CPU): a step
runs, its loss and gradients are close to fp32's, parameters stay fp32. As an
encoder, core runs the backward outside autocast, where megatron's linear
functions need the forward's autocast state replayed (CUDA-only custom_bwd)."""

from __future__ import annotations

import math

import pytest
import torch
from dropout_cases import tp_bf16_rank
from toy_encoder import ToyEncoderFamily, encoder_rank
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


def test_bf16_encoder_backward_outside_autocast():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(5, 32, generator=g), torch.randn(3, 32, generator=g)]
    gs = [torch.randn(5, 24, generator=g), torch.randn(3, 24, generator=g)]
    ref = ToyEncoderFamily(".").build()
    outs = [ref(x) for x in xs]
    torch.autograd.backward(outs, gs)
    res = run_ranks(encoder_rank, 2, 2, xs, gs, torch.bfloat16)
    # (the last row linear adds its fp32 bias after the bf16 matmul, so values come out fp32)
    assert res[0]["dtypes"] == {"torch.float32"}
    for got, want in zip(res[0]["values"], outs):
        got = torch.from_numpy(got)
        assert not torch.equal(got, want.detach()) and rel(got, want.detach()) <= 2e-2, "bf16 matmuls"
    for n, p in ref.named_parameters():
        assert rel(torch.from_numpy(res[0]["grads"][n]), p.grad) <= 5e-2, n
