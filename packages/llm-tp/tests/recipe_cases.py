"""Rank function of the precision-recipe tests (importable by spawned ranks): megatron_tp with
sequence parallelism at degree 2 under each ``train.precision`` recipe, then the same recipe at
degree 1 in a group of one (the two ranks share those cases; ``disagg.testing.recipes``), one
spawn for all of it."""

from __future__ import annotations

from dropout_cases import BF16_OPTIM, SEED

from disagg.testing import ranks
from disagg.testing.recipes import STEPS, recipe_steps, single_rank_share

RECIPES = ("bf16", "bf16-pure")


def _run(rank: int, path: str, degree: int, precision: str, samples, embeds, steps: int = STEPS) -> dict:
    from disagg_llm_tp.families.qwen2 import Qwen2Family
    from disagg_llm_tp.strategy import MegatronTPStrategy

    ctx = ranks.rank_context("llm", rank, degree, 1, seed=SEED, precision=precision)
    fam = Qwen2Family(path, {"attn_implementation": "eager"})
    strat = ranks.strategy_rank(
        MegatronTPStrategy, fam, ctx, options={"sequence_parallel": degree > 1}, optim=BF16_OPTIM
    )
    strat.module.eval()  # compare arithmetic, not dropout masks
    total = sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    # encoder rows arrive in the compute dtype (the encoder's output under the same recipe)
    rows = [{k: v.to(ctx.dtype) for k, v in e.items()} for e in embeds]
    seen: dict = {}

    def microbatch(strat) -> float:
        leaves = ranks.leaves(rows)
        loss = ranks.loss_and_backward(strat, 0, samples, leaves, 1.0 / total)
        seen["embed_grad_dtypes"] = {v.grad.dtype for e in leaves for v in e.values()}
        return loss

    out = recipe_steps(strat, microbatch, steps=steps, copies=degree)
    return {**out, **seen}


def tp_recipe_rank(rank: int, path: str, samples, embeds) -> bytes:
    out: dict = {}
    # fp32: one step, for the state bytes of every recipe
    for precision, steps in (("fp32", 1), *((r, STEPS) for r in RECIPES)):
        out[("tp2", precision)] = _run(rank, path, 2, precision, samples, embeds, steps)
    for precision in single_rank_share(list(RECIPES), rank, 2):
        out[("tp1", precision)] = _run(0, path, 1, precision, samples, embeds)
    return ranks.dumps(out)
