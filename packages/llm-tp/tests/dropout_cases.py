"""Rank functions for the dropout tests (and the recipe tests' AdamW settings) (importable by spawned ranks).

Dropout masks are observed with core's dropout spy (``disagg.testing.dropout``)
on ``torch.nn.functional.dropout``, which HF's eager attention calls on the
attention probabilities: the mask of a call is where a positive probability
came out zero.
"""

from __future__ import annotations

import torch

from disagg.interfaces import OptimSpec
from disagg.testing import ranks
from disagg.testing.dropout import dropout_spy
from disagg.testing.ranks import dumps

__all__ = ["BF16_OPTIM", "P", "SEED", "dropout_spy", "tp_dropout_rank"]

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
