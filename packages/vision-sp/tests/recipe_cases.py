"""Rank function of the precision-recipe tests (importable by spawned ranks): the tiny LLaVA
tower under each ``train.precision`` recipe as ``ulysses`` at degree 2, ``ulysses`` at degree 2
with its state sharded by FSDP2 (``shard: parameters``; ``bf16`` also with ZeRO-1,
``shard: optimizer``) and ``ddp`` over 2 replicas (uneven: 2
samples and 1), then each strategy at degree 1 in a group of one (the two ranks share those
cases; ``disagg.testing.recipes``): one spawn for all of it."""

from __future__ import annotations

from pathlib import Path

from disagg.interfaces import OptimSpec
from disagg.testing import ranks
from disagg.testing.recipes import STEPS, recipe_steps, single_rank_share, squared_error_microbatch

RECIPES = ("bf16", "bf16-pure")
SEED = 7
#: eps above the bf16 gradient noise keeps AdamW's first update Lipschitz in the gradient
#: (disagg.testing.tolerance), as the end-to-end configs' eps = 1e-3
OPTIM = OptimSpec(lr=1e-3, eps=1e-3)


def _run(
    rank: int,
    strategy: str,
    degree: int,
    replicas: int,
    precision: str,
    path: str,
    inputs,
    targets,
    steps: int,
) -> dict:
    from disagg.builtin.ddp import DDPStrategy
    from disagg_vision_sp.families.llava import LlavaVision
    from disagg_vision_sp.ulysses.strategy import UlyssesStrategy

    ctx = ranks.rank_context("vision", rank, degree, replicas, seed=SEED, precision=precision)
    family = LlavaVision(Path(path), {"attn_implementation": "eager"})
    cls, options = {
        "ulysses": (UlyssesStrategy, {}),
        "ulysses-fsdp": (UlyssesStrategy, {"shard": "parameters"}),
        "ulysses-zero1": (UlyssesStrategy, {"shard": "optimizer"}),
        "ddp": (DDPStrategy, {}),
    }[strategy]
    strat = ranks.strategy_rank(cls, family, ctx, options=options, optim=OPTIM)
    strat.module.eval()  # compare arithmetic, not dropout masks
    if cls is DDPStrategy:  # replicas read disjoint samples: the first one more
        cut = (len(inputs) + 1) // 2
        mine = slice(None) if replicas == 1 else slice(0, cut) if ctx.replica == 0 else slice(cut, None)
        inputs, targets = inputs[mine], targets[mine]
    seen: dict = {}
    microbatch = squared_error_microbatch(inputs, targets, seen)
    return {**recipe_steps(strat, microbatch, steps=steps), **seen}


def recipe_rank(rank: int, path: str, inputs, targets) -> bytes:
    out: dict = {("ulysses", 2, "fp32"): _run(rank, "ulysses", 2, 1, "fp32", path, inputs, targets, 1)}
    layouts = [
        (r, s, d, n)
        for r in RECIPES
        for s, d, n in (("ulysses", 2, 1), ("ulysses-fsdp", 2, 1), ("ddp", 1, 2))
    ]
    # ZeroRedundancyOptimizer over the fp32 masters (bf16 only: under bf16-pure it steps the weights)
    layouts.append(("bf16", "ulysses-zero1", 2, 1))
    for precision, strategy, degree, replicas in layouts:
        key = (strategy, degree * replicas, precision)
        out[key] = _run(rank, strategy, degree, replicas, precision, path, inputs, targets, STEPS)
    singles = [(strategy, precision) for precision in RECIPES for strategy in ("ulysses", "ddp")]
    for strategy, precision in single_rank_share(singles, rank, 2):
        out[(strategy, 1, precision)] = _run(0, strategy, 1, 1, precision, path, inputs, targets, STEPS)
    return ranks.dumps(out)
