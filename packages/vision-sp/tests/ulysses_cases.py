"""Rank functions for the ulysses dropout and bf16 tests (importable by spawned ranks).

Masks are observed with core's dropout spy (``disagg.testing.dropout``) on
``torch.nn.functional.dropout``, which SigLIP's eager attention calls on the
attention probabilities.
"""

from __future__ import annotations

from pathlib import Path

import torch

from disagg.interfaces import compute_dtype
from disagg.testing import ranks
from disagg.testing.dropout import dropout_spy
from disagg.testing.ranks import dumps, loads

__all__ = ["P", "SEED", "bf16_rank", "dropout_rank", "dropout_spy", "dumps", "loads"]

SEED = 7
P = 0.25  # the tower's attention_dropout in the dropout test


def _strategy(rank: int, degree: int, replicas: int, path: str):
    from disagg_vision_sp.families.llava import LlavaVision
    from disagg_vision_sp.ulysses.strategy import UlyssesStrategy

    ctx = ranks.rank_context("vision", rank, degree, replicas, seed=SEED)
    family = LlavaVision(Path(path), {"attn_implementation": "eager"})
    return ranks.strategy_rank(UlyssesStrategy, family, ctx, train=True)  # train mode, as core's worker


def _dot(shards, grads) -> float:  # noqa: ANN001
    """This rank's part of sum_i <output_i, grad_i>; the ranks of a replica add up to the whole."""
    return float(sum((s.value.double() * g[s.positions].double()).sum() for s, g in zip(shards, grads)))


def dropout_rank(rank: int, degree: int, replicas: int, path: str, inputs, grads, draws: int) -> bytes:
    """Every replica encodes all ``inputs``, so masks could only differ by seed."""
    out: dict = {}
    for run in ("first", "again"):  # a fresh set-up with the same seed
        strat = _strategy(rank, degree, replicas, path)
        with dropout_spy() as masks:
            shards = ranks.encode(strat, 0, inputs)
        ranks.backward(strat, 0, shards, [g[s.positions] for s, g in zip(shards, grads)])
        out[run] = {
            "dot": _dot(shards, grads),
            "masks": masks,
            "grads": {n: p.grad.clone() for n, p in strat.module.named_parameters() if p.grad is not None},
        }
    dots = []
    with torch.no_grad():  # fresh draws of the same stream, for the statistics
        for mb in range(1, draws + 1):
            dots.append(_dot(ranks.encode(strat, mb, inputs), grads))
            ranks.release(strat, mb)
    out["dots"] = dots
    return dumps(out)


def bf16_rank(rank: int, degree: int, path: str, inputs, grads) -> bytes:
    """One step in fp32 and one under core's bf16 autocast, from the same weights."""
    out: dict = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        strat = _strategy(rank, degree, 1, path)
        strat.module.eval()  # compare arithmetic, not dropout masks
        with compute_dtype(torch.device("cpu"), dtype):
            shards = ranks.encode(strat, 0, inputs)
        ranks.backward(strat, 0, shards, [g[s.positions] for s, g in zip(shards, grads)])
        norm_sq, full = ranks.finish_step(strat, zero_grad=False)  # unclipped; grads kept for dtypes
        out[name] = {
            "dot": _dot(shards, grads),
            "shards": [(s.positions, s.value.detach(), s.total) for s in shards],
            "grads": full,
            "out_dtypes": {s.value.dtype for s in shards},
            "norm_sq": norm_sq,
            **ranks.state_dtypes(strat),
            "params": ranks.full_state(strat),
        }
    return dumps(out)
