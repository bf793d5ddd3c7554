"""megatron_tp on an encoder family: shard 0 ships the whole output, the other
TP ranks ship empty shards, and gradients equal the single-process module; under
``train.precision: bf16`` (same spawn) the rows are bf16, the gradients fp32 (the masters'),
both within the bf16 bound of the fp32 single-process module."""

from __future__ import annotations

import torch
from toy_encoder import ToyEncoderFamily, encoder_rank

from disagg.testing.dist import run_ranks
from disagg.testing.tolerance import BF16, assert_tensor_close, assert_tensors_close


def test_encoder_tp_matches_single_process():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(5, 32, generator=g), torch.randn(3, 32, generator=g)]
    gs = [torch.randn(5, 24, generator=g), torch.randn(3, 24, generator=g)]
    ref = ToyEncoderFamily(".").build()
    outs_ref = [ref(x) for x in xs]
    torch.autograd.backward(outs_ref, gs)
    both = run_ranks(encoder_rank, 2, 2, xs, gs, ("fp32", "bf16"))
    want_grads = {n: p.grad for n, p in ref.named_parameters()}
    for precision, bound, dtype in (("fp32", None, "torch.float32"), ("bf16", BF16, "torch.bfloat16")):
        res = [r[precision] for r in both]
        kw = {} if bound is None else {"precision": bound}
        assert res[0]["rows"] == [5, 3] and res[1]["rows"] == [0, 0]
        assert res[0]["dtypes"] == {dtype} and res[0]["grad_dtypes"] == {"torch.float32"}
        for i, (got, want) in enumerate(zip(res[0]["values"], outs_ref)):
            assert_tensor_close(torch.from_numpy(got), want.detach(), f"{precision} sample {i} output", **kw)
        got_grads = {n: torch.from_numpy(g) for n, g in res[0]["grads"].items()}
        assert_tensors_close(got_grads, want_grads, f"{precision} gradient of ", **kw)
