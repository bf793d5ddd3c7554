"""Rank function of the audio precision-recipe tests (importable by spawned ranks): each audio
tower under each ``train.precision`` recipe as ``ulysses`` and ``megatron_tp`` at degree 2, then
each at degree 1 in a group of one (the two ranks share those cases; ``disagg.testing.recipes``):
one spawn for all of it."""

from __future__ import annotations

from pathlib import Path

from disagg.interfaces import OptimSpec
from disagg.testing import ranks
from disagg.testing.recipes import STEPS, recipe_steps, single_rank_share, squared_error_microbatch

RECIPES = ("bf16", "bf16-pure")
STRATEGIES = ("ulysses", "megatron_tp")
SEED = 5
#: eps above the bf16 gradient noise keeps AdamW's first update Lipschitz in the gradient
#: (disagg.testing.tolerance), as the end-to-end configs' eps = 1e-3
OPTIM = OptimSpec(lr=1e-3, eps=1e-3)


def _strategy(name: str) -> type:
    if name == "ulysses":
        from disagg_vision_sp.ulysses.strategy import UlyssesStrategy

        return UlyssesStrategy
    from disagg_llm_tp.strategy import MegatronTPStrategy

    return MegatronTPStrategy


def _run(rank: int, degree: int, strategy: str, precision: str, case: tuple) -> dict:
    family_cls, path, options, inputs, targets = case
    family = family_cls(Path(path), {**options, "attn_implementation": "eager"})
    ctx = ranks.rank_context("audio", rank, degree, 1, seed=SEED, precision=precision)
    strat = ranks.strategy_rank(_strategy(strategy), family, ctx, optim=OPTIM)
    strat.module.eval()  # compare arithmetic, not dropout masks
    seen: dict = {}
    out = recipe_steps(strat, squared_error_microbatch(inputs, targets, seen), steps=STEPS)
    return {**out, **seen}


def audio_recipe_rank(rank: int, cases: dict[str, tuple], keys: list[tuple[str, str, str]]) -> bytes:
    """``cases``: per family name, ``(family class, path, options, inputs, targets)``; ``keys``:
    the ``(family, strategy, recipe)`` runs."""
    out: dict = {(name, s, 2, p): _run(rank, 2, s, p, cases[name]) for name, s, p in keys}
    for name, s, p in single_rank_share(keys, rank, 2):
        out[(name, s, 1, p)] = _run(0, 1, s, p, cases[name])
    return ranks.dumps(out)
