"""megatron_tp on an encoder family: shard 0 ships the whole output, the other
TP ranks ship empty shards, and gradients equal the single-process module."""

from __future__ import annotations

import torch
from toy_encoder import ToyEncoderFamily, encoder_rank
from tp_cases import rel

from disagg.testing.dist import run_ranks


def test_encoder_tp_matches_single_process():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(5, 32, generator=g), torch.randn(3, 32, generator=g)]
    gs = [torch.randn(5, 24, generator=g), torch.randn(3, 24, generator=g)]
    ref = ToyEncoderFamily(".").build()
    outs_ref = [ref(x) for x in xs]
    torch.autograd.backward(outs_ref, gs)
    res = run_ranks(encoder_rank, 2, 2, xs, gs)
    assert res[0]["rows"] == [5, 3] and res[1]["rows"] == [0, 0]
    for got, want in zip(res[0]["values"], outs_ref):
        assert rel(torch.from_numpy(got), want.detach()) <= 1e-5
    for n, p in ref.named_parameters():
        assert rel(torch.from_numpy(res[0]["grads"][n]), p.grad) <= 1e-5, n
