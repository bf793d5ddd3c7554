"""Rank functions for the ulysses dropout and bf16 tests (importable by spawned ranks).

Masks are observed with a spy on ``torch.nn.functional.dropout``, which
SigLIP's eager attention calls on the attention probabilities.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from disagg.interfaces import GroupContext, OptimSpec, StrategyOptions, compute_dtype, dropout_seed

SEED = 7
P = 0.25  # the tower's attention_dropout in the dropout test


def dumps(obj) -> bytes:  # noqa: ANN001
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def loads(raw: bytes):  # noqa: ANN201
    return torch.load(io.BytesIO(raw), weights_only=False)


@contextlib.contextmanager
def dropout_spy() -> Iterator[list[torch.Tensor]]:
    """Kept (1) / dropped (0) mask of every active dropout call; -1 where the
    input was already zero."""
    masks: list[torch.Tensor] = []
    real = F.dropout

    def spy(x, p=0.5, training=True, inplace=False):  # noqa: ANN001
        out = real(x, p, training, inplace)
        if training and p > 0:
            masks.append(torch.where(x.detach() != 0, (out.detach() != 0).to(torch.int8), -1))
        return out

    F.dropout = spy
    try:
        yield masks
    finally:
        F.dropout = real


def _strategy(rank: int, degree: int, replicas: int, path: str):
    from disagg_vision_sp.families.llava import LlavaVision
    from disagg_vision_sp.ulysses.strategy import UlyssesStrategy

    ctx = GroupContext(
        module="vision",
        rank=rank,
        world_size=degree * replicas,
        degree=degree,
        replicas=replicas,
        device=torch.device("cpu"),
        dtype=torch.float32,
        seed=SEED,
    )
    family = LlavaVision(Path(path), {"attn_implementation": "eager"})
    strat = UlyssesStrategy(ctx, family, StrategyOptions())
    strat.setup(family.build(torch.float32), OptimSpec(lr=1e-3))
    strat.module.train()  # what core's worker does after set-up
    torch.manual_seed(dropout_seed(SEED, ctx.replica))
    return strat


def _dot(shards, grads) -> float:  # noqa: ANN001
    """This rank's part of sum_i <output_i, grad_i>; the ranks of a replica add up to the whole."""
    return float(sum((s.value.double() * g[s.positions].double()).sum() for s, g in zip(shards, grads)))


def dropout_rank(rank: int, degree: int, replicas: int, path: str, inputs, grads, draws: int) -> bytes:
    """Every replica encodes all ``inputs``, so masks could only differ by seed."""
    out: dict = {}
    for run in ("first", "again"):  # a fresh set-up with the same seed
        strat = _strategy(rank, degree, replicas, path)
        with dropout_spy() as masks:
            shards = strat.encode(0, inputs)
        strat.backward(0, [s.value for s in shards], [g[s.positions] for s, g in zip(shards, grads)])
        out[run] = {
            "dot": _dot(shards, grads),
            "masks": masks,
            "grads": {n: p.grad.clone() for n, p in strat.module.named_parameters() if p.grad is not None},
        }
    dots = []
    with torch.no_grad():  # fresh draws of the same stream, for the statistics
        for mb in range(1, draws + 1):
            dots.append(_dot(strat.encode(mb, inputs), grads))
            strat.release(mb)
    out["dots"] = dots
    return dumps(out)


def bf16_rank(rank: int, degree: int, path: str, inputs, grads) -> bytes:
    """One step in fp32 and one under core's bf16 autocast, from the same weights."""
    out: dict = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        strat = _strategy(rank, degree, 1, path)
        strat.module.eval()  # compare arithmetic, not dropout masks
        with compute_dtype(torch.device("cpu"), dtype):
            shards = strat.encode(0, inputs)
        strat.backward(0, [s.value for s in shards], [g[s.positions] for s, g in zip(shards, grads)])
        strat.reduce_gradients()
        norm_sq = strat.grad_norm_sq()
        full = {n: g.clone() for n, g in strat.full_grads().items()}  # collective: every rank
        strat.step(1.0)
        out[name] = {
            "dot": _dot(shards, grads),
            "shards": [(s.positions, s.value.detach(), s.total) for s in shards],
            "grads": full,
            "out_dtypes": {s.value.dtype for s in shards},
            "norm_sq": norm_sq,
            "param_dtypes": {p.dtype for p in strat.module.parameters()},
            "grad_dtypes": {p.grad.dtype for p in strat.module.parameters() if p.grad is not None},
            "state_dtypes": {
                v.dtype for st in strat.optimizer.state.values() for v in st.values() if v.dim() > 0
            },
            "params": strat.full_state_dict(),
        }
    return dumps(out)
