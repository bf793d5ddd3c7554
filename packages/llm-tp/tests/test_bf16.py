"""megatron_tp under core's bf16 rule (``compute_dtype``: fp32 parameters,
gradients and optimizer state; the forward autocast to bf16 on the CPU) equals
the single-process Hugging Face model run under the same rule
(``tp_bf16_reference``): loss, every parameter gradient and input-embedding
gradient per element within the policy's bf16 bound, and parameters after the
AdamW step in units of the learning rate, a bound tight enough that a skipped
update or one applied twice fails (shown). As an encoder, core runs the backward
outside autocast, where megatron's linear functions need the forward's autocast
state replayed (CUDA-only custom_bwd)."""

from __future__ import annotations

import pytest
import torch
from dropout_cases import tp_bf16_rank
from toy_encoder import ToyEncoderFamily, encoder_rank
from tp_bf16_reference import BF16_COMPUTE, OPTIM, hf_bf16_step
from tp_cases import make_batch, rel

from disagg.testing.dist import run_ranks
from disagg.testing.ranks import loads as _loads
from disagg.testing.tolerance import (
    BF16,
    assert_params_close,
    assert_scalar_close,
    assert_tensor_close,
    assert_tensors_close,
)
from disagg_llm_tp.families.qwen2 import Qwen2Family


@pytest.fixture(scope="module")
def bf16_case(tiny_dirs):
    path = tiny_dirs["qwen2"]
    family = Qwen2Family(path)
    samples, embeds = make_batch(family, n_samples=4)
    outs = [_loads(b) for b in run_ranks(tp_bf16_rank, 2, path, 2, samples, embeds)]
    ref = hf_bf16_step(path, samples, embeds, family.placeholder_token_id("vision"))
    return outs, ref


def _assert_step_matches(res: dict, ref: dict) -> None:
    assert_scalar_close(res["loss"], ref["loss"], "bf16 loss sum", BF16)
    prec = ref["precisions"]
    assert set(res["grads"]) == set(ref["grads"]), sorted(set(res["grads"]) ^ set(ref["grads"]))
    for n, g in ref["grads"].items():
        assert_tensor_close(res["grads"][n], g, f"bf16 grad {n}", prec[n])
    for i, (a, b) in enumerate(zip(res["embed_grads"], ref["embed_grads"])):
        assert_tensors_close(a, b, f"bf16 embedding grad of sample {i} ", BF16)
    assert set(res["params"]) == set(ref["params"]), sorted(set(res["params"]) ^ set(ref["params"]))
    for n, want in ref["params"].items():
        g = ref["grads_by_state_name"].get(n)
        assert_params_close(
            {n: res["params"][n]},
            {n: want},
            lr=OPTIM.lr,
            steps=1,
            grads={} if g is None else {n: g},
            what="bf16 ",
            precision=prec.get(n, BF16_COMPUTE),
            betas=OPTIM.betas,
            eps=OPTIM.eps,
        )


def test_bf16_step_equals_hf_in_bf16(bf16_case):
    outs, ref = bf16_case
    for res in outs:
        fp32, bf16 = res["fp32"], res["bf16"]
        assert bf16["loss"] != fp32["loss"], "the forward must really run in bf16"
        for key in ("param_dtypes", "grad_dtypes", "state_dtypes"):
            assert bf16[key] == {torch.float32}, key
        _assert_step_matches(bf16, ref)


@pytest.mark.parametrize("wrong", ["skipped", "applied twice"])
def test_a_wrong_bf16_update_is_caught(bf16_case, wrong):
    """The same comparison fails for an update that was skipped or applied twice."""
    outs, ref = bf16_case
    got = outs[0]["bf16"]
    p0 = ref["initial"]
    factor = 0.0 if wrong == "skipped" else 2.0
    bad = {n: p0[n] + factor * (p - p0[n]) for n, p in got["params"].items()}
    with pytest.raises(AssertionError, match="lr-units"):
        _assert_step_matches({**got, "params": bad}, ref)


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
