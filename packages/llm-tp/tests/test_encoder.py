"""megatron_tp on an encoder family: shard 0 ships the whole output, the other
TP ranks ship empty shards, and gradients equal the single-process module."""

from __future__ import annotations

import torch
from toy_encoder import ToyEncoderFamily, encoder_rank

from disagg.testing.dist import run_ranks
from disagg.testing.tolerance import assert_tensor_close, assert_tensors_close


def test_encoder_tp_matches_single_process():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(5, 32, generator=g), torch.randn(3, 32, generator=g)]
    gs = [torch.randn(5, 24, generator=g), torch.randn(3, 24, generator=g)]
    ref = ToyEncoderFamily(".").build()
    outs_ref = [ref(x) for x in xs]
    torch.autograd.backward(outs_ref, gs)
    res = run_ranks(encoder_rank, 2, 2, xs, gs)
    assert res[0]["rows"] == [5, 3] and res[1]["rows"] == [0, 0]
    for i, (got, want) in enumerate(zip(res[0]["values"], outs_ref)):
        assert_tensor_close(torch.from_numpy(got), want.detach(), f"sample {i} output")
    got_grads = {n: torch.from_numpy(g) for n, g in res[0]["grads"].items()}
    assert_tensors_close(got_grads, {n: p.grad for n, p in ref.named_parameters()}, "gradient of ")
