"""A tiny attention encoder family with a fused qkv projection, so the encoder
path of megatron_tp (uniform-TP baseline) is tested without other plugins."""

from __future__ import annotations

import torch
from torch import nn

from disagg.interfaces import EncoderFamily, LayerMap


class Attn(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.num_heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).reshape(x.shape[0], 3, self.num_heads, -1).permute(1, 2, 0, 3).unbind(0)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(o.transpose(0, 1).reshape(x.shape[0], -1))


class Encoder(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, out: int = 24):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attn(dim, heads)
        self.fc1 = nn.Linear(dim, 64)
        self.fc2 = nn.Linear(64, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class ToyEncoderFamily(EncoderFamily):
    name = "toy_tp_encoder"
    modality = "image"

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        torch.manual_seed(0)
        return Encoder().to(dtype)

    def layer_map(self) -> LayerMap:
        return LayerMap(
            column=("attn.qkv", "fc1"),
            row=("attn.proj", "fc2"),
            heads={"attn": ("num_heads",)},
            column_chunks={"attn.qkv": 3},
            replicated=("norm.*",),
        )

    def preprocess(self, media):
        raise NotImplementedError

    def num_tokens(self, inputs):
        return [inputs["x"].shape[0]]

    def encode(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return module(inputs["x"])

    def export_state(self, state):
        return state


def encoder_rank(rank: int, degree: int, xs: list, gs: list, precisions: tuple[str, ...] = ("fp32",)) -> dict:
    """Encode, then backward from the shard-0 gradients, as core's worker does; one result per
    ``train.precision`` recipe in ``precisions`` (a dict by recipe when there are several)."""
    if len(precisions) > 1:
        return {p: encoder_rank(rank, degree, xs, gs, (p,)) for p in precisions}
    from disagg.testing import ranks
    from disagg_llm_tp.strategy import MegatronTPStrategy

    ctx = ranks.rank_context("vision", rank, degree, 1, precision=precisions[0])
    fam = ToyEncoderFamily(".")
    strat = ranks.strategy_rank(MegatronTPStrategy, fam, ctx)
    shards = ranks.encode(strat, 0, [{"x": x} for x in xs])
    grads = [g if ctx.shard == 0 else torch.zeros(0, g.shape[1]) for g in gs]
    ranks.backward(strat, 0, shards, grads)
    ranks.reduce_gradients(strat)
    return {
        "rows": [int(s.value.shape[0]) for s in shards],
        "values": [s.value.detach().float().numpy().copy() for s in shards],
        "dtypes": {str(s.value.dtype) for s in shards},
        "grad_dtypes": {str(g.dtype) for g in ranks.full_grads(strat).values()},
        "grads": {k: v.numpy() for k, v in ranks.full_grads(strat).items()},
    }
