"""Rank functions for the ulysses dropout tests (importable by spawned ranks).

Masks are observed with core's dropout spy (``disagg.testing.dropout``) on
``torch.nn.functional.dropout``, which SigLIP's eager attention calls on the
attention probabilities.
"""

from __future__ import annotations

from pathlib import Path

import torch

from disagg.testing import ranks
from disagg.testing.dropout import dropout_spy
from disagg.testing.ranks import dumps, loads

__all__ = ["P", "SEED", "dropout_rank", "dropout_spy", "dumps", "loads"]

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
