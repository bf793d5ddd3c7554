"""Rank functions for the dropout and bf16 tests (importable by spawned ranks).

Dropout masks are observed with core's dropout spy (``disagg.testing.dropout``)
on ``torch.nn.functional.dropout``, which HF's eager attention calls on the
attention probabilities: the mask of a call is where a positive probability
came out zero.
"""

from __future__ import annotations

import torch

from disagg.interfaces import OptimSpec, compute_dtype
from disagg.testing import ranks
from disagg.testing.dropout import dropout_spy
from disagg.testing.ranks import dumps

__all__ = ["P", "SEED", "dropout_spy", "tp_bf16_rank", "tp_dropout_rank"]

SEED = 7
P = 0.25  # attention_dropout of the tiny model
#: the bf16 step's AdamW: eps above the bf16 gradient noise keeps the first update Lipschitz in
#: the gradient (with eps ~0 it is lr * sign(g), and a noise-level element's sign flips by rounding:
#: Adam's hard limit, 2 lr; ``disagg.testing.tolerance``), as the end-to-end configs' eps = 1e-3
BF16_OPTIM = OptimSpec(lr=1e-3, eps=1e-3)


def _strategy(rank: int, path: str, degree: int, replicas: int, optim: OptimSpec | None = None):
    from disagg_llm_tp.families.qwen2 import Qwen2Family
    from disagg_llm_tp.strategy import MegatronTPStrategy

    ctx = ranks.rank_context("llm", rank, degree, replicas, seed=SEED)
    fam = Qwen2Family(path, {"attn_implementation": "eager"})
    # What core's worker does after set-up: train mode, the default RNG per replica.
    return ranks.strategy_rank(MegatronTPStrategy, fam, ctx, optim=optim or OptimSpec(lr=1e-3), train=True)


def tp_dropout_rank(rank: int, path: str, degree: int, replicas: int, samples, embeds, draws: int) -> bytes:
    """Every replica gets the same samples, so masks could only differ by seed."""
    out: dict = {}
    for run in ("first", "again"):  # a fresh set-up with the same seed
        strat = _strategy(rank, path, degree, replicas)
        leaves = ranks.leaves(embeds)
        with dropout_spy() as masks:
            loss = ranks.loss_and_backward(strat, 0, samples, leaves, 1.0)
        out[run] = {
            "loss": loss,
            "masks": masks,
            # the forks leave the default stream alone: TP ranks keep drawing alike on it
            "default_rng": torch.get_rng_state(),
            "embed_grads": [{k: v.grad for k, v in e.items()} for e in leaves],
        }
    with torch.no_grad():  # fresh draws of the same stream, for the statistics
        out["losses"] = [ranks.evaluate(strat, samples, embeds)[0] for _ in range(draws)]
    if degree == 1:
        ranks.reduce_gradients(strat)
        out["grads"] = ranks.full_grads(strat)
    return dumps(out)


def tp_bf16_rank(rank: int, path: str, degree: int, samples, embeds) -> bytes:
    """One step in fp32 and one under core's bf16 autocast, from the same weights."""
    total = sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    out: dict = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        strat = _strategy(rank, path, degree, 1, BF16_OPTIM)
        strat.module.eval()  # compare arithmetic, not dropout masks
        leaves = ranks.leaves(embeds)
        with compute_dtype(torch.device("cpu"), dtype):
            loss = ranks.loss_and_backward(strat, 0, samples, leaves, 1.0 / total)
        norm_sq, grads = ranks.finish_step(strat, zero_grad=False)  # unclipped; grads kept for dtypes
        out[name] = {
            "loss": loss,
            "norm_sq": norm_sq,
            "grads": grads,
            "embed_grads": [{k: v.grad for k, v in e.items()} for e in leaves],
            **ranks.state_dtypes(strat),
            "params": ranks.full_state(strat),
        }
    return dumps(out)
