"""Rank functions for the ulysses dropout tests (importable by spawned ranks), and the
equivalence tests' shared case and check (:func:`tower_case`, :func:`assert_ulysses_matches`).

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

__all__ = [
    "P",
    "SEED",
    "assert_ulysses_matches",
    "dropout_rank",
    "dropout_spy",
    "dumps",
    "loads",
    "tower_case",
]

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


def tower_case(family, samples: list[list[tuple[int, int]]]) -> tuple:  # noqa: ANN001
    """``family``'s inputs for ``samples`` (random images of those (width, height) sizes), the
    upstream gradients of its outputs, and the single-process outputs and parameter gradients."""
    from disagg_vision_sp.testing import random_images, reference, upstream_grads

    inputs = [family.preprocess(random_images(s, seed=i)) for i, s in enumerate(samples)]
    grads = upstream_grads(family, inputs)
    outs, pgrads = reference(family, inputs, grads)
    return family, inputs, grads, outs, pgrads


def assert_ulysses_matches(case: tuple, degree: int, replicas: int) -> list[dict]:
    """Ulysses at ``degree`` x ``replicas`` on a :func:`tower_case`: every sample's output and
    every parameter gradient equal the single-process tower's, and every rank reports the same
    group norm, the single-process one. Returns the ranks' results."""
    from disagg.testing.tolerance import assert_scalar_close
    from disagg_vision_sp.testing import assemble, assert_close, assert_grads_close, run_ulysses

    family, inputs, grads, ref_outs, ref_grads = case
    results = run_ulysses(degree, replicas, family, inputs, grads)
    outs = assemble(results, len(inputs), family.hidden_size())
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert_close(o, r, f"sample {i} output")
    assert_grads_close(results[0]["grads"], ref_grads)
    ref_norm = sum(float(g.double().pow(2).sum()) for g in ref_grads.values())
    for res in results:
        assert_scalar_close(res["grad_norm_sq"], ref_norm, "grad_norm_sq")
    return results
