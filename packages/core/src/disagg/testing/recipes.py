"""The precision-recipe tests' kit (``train.precision``: ``bf16``, ``bf16-pure``): a few steps of
one strategy under one recipe, run as the worker runs them, and the comparison of two layouts of
the same recipe (degree 2 against degree 1) under the tolerance policy.

A strategy's test spawns its ranks once (:func:`disagg.testing.dist.run_ranks`); each rank runs
:func:`recipe_steps` at degree 2 for every recipe, then rank 0 alone becomes a one-rank group
(:func:`single_rank_group`) and runs the same steps at degree 1: no second spawn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from disagg.interfaces import RECIPES, Strategy
from disagg.testing import ranks
from disagg.testing.tolerance import (
    BF16_LOSS,
    RECIPE_PRECISION,
    assert_params_close,
    assert_scalar_close,
    assert_tensors_close,
)

#: the steps of a recipe comparison (the issue's "5 steps")
STEPS = 5


def single_rank_group() -> None:
    """Leave the spawned group and make this process a group of one (for the degree-1 side)."""
    from disagg.testing.dist import free_port

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def recipe_steps(
    strat: Strategy,
    microbatch: Callable[[Strategy], float],
    steps: int = STEPS,
    copies: int = 1,
) -> dict[str, Any]:
    """``steps`` unclipped steps of ``strat`` (set up under its recipe, in eval mode: arithmetic,
    not dropout masks, is compared). ``microbatch`` runs this rank's forward and backward of the
    step's samples and returns its part of the loss; parts are summed over the group and divided
    by ``copies`` (ranks holding the same part, e.g. the TP ranks of a replica).

    Returns the losses, the parameters before the steps, the first step's merged gradients,
    the parameters after the last step (the full form: masters under ``bf16``), dtypes as held,
    and this rank's state bytes after the last step (before its gradients are dropped), with
    the parameter elements it holds and the bytes of AdamW's scalar step counts."""
    assert strat.module is not None and strat.optimizer is not None
    out: dict[str, Any] = {"losses": [], "initial": ranks.full_state(strat)}
    for t in range(steps):
        part = torch.tensor([microbatch(strat)], dtype=torch.float64)
        dist.all_reduce(part)
        out["losses"].append(float(part) / copies)
        if t == 0:
            out["partials"] = _partial_peaks(strat)
        norm_sq = ranks.reduce(strat)
        if t == 0:
            out["grads"] = ranks.full_grads(strat)
        ranks.step(strat, norm_sq, None, zero_grad=False)
        if t == steps - 1:
            out.update(ranks.state_dtypes(strat))
            out.update(ranks.state_census(strat))
        ranks.zero_grad(strat)
    out["params"] = ranks.full_state(strat)
    # a tied weight (lm_head = embed_tokens) is in the state under each name, its gradient under one
    by_id = {id(p): n for n, p in strat.module.named_parameters()}
    out["tied"] = {
        n: by_id[id(t)]
        for n, t in strat.module.state_dict(keep_vars=True).items()
        if isinstance(t, torch.nn.Parameter) and by_id.get(id(t), n) != n
    }
    return out


def held_dtypes(precision: str) -> tuple[set[torch.dtype], ...]:
    """The dtypes a rank must hold under ``precision``, as :func:`recipe_steps`' census reports
    them: weights, what the optimizer steps (the master, or the weights without one), gradients
    as the optimizer sees them and AdamW moments, each a set of one."""
    r = RECIPES[precision]
    stepped = r.master or r.weights
    return ({r.weights}, {stepped}, {r.grads}, {r.moments})


def _partial_peaks(strat: Strategy) -> dict[str, float]:
    """Per parameter, the largest |element| of any rank's gradient before the group's sum (a
    collective): a summed gradient is the sum of the ranks' partials, each rounded in the compute
    dtype, and when the tokens' terms cancel a partial can exceed the sum it makes."""
    mine = {n: float(g.abs().max()) if g.numel() else 0.0 for n, g in ranks.full_grads(strat).items()}
    every: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    return {n: max(d.get(n, 0.0) for d in every) for n in set().union(*every)}


def expected_state_bytes(result: dict[str, Any], precision: str) -> int:
    """What :meth:`~disagg.interfaces.Parallelizer.state_bytes` must measure (``result``: a
    :func:`recipe_steps` census): every stepped element at ``Recipe.state_bytes_per_element``, a
    trainable one that never got a gradient at its weight and master, a frozen one at its
    weight, plus AdamW's scalar step counts."""
    recipe = RECIPES[precision]
    weight = recipe.state_bytes_per_element(trainable=False)
    master = recipe.master_bytes
    return (
        result["stepped_elements"] * recipe.state_bytes_per_element(trainable=True)
        + result["idle_elements"] * (weight + master)
        + result["frozen_elements"] * weight
        + result["scalar_bytes"]
    )


def assert_same_recipe(
    got: dict[str, Any],
    want: dict[str, Any],
    precision: str,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    what: str = "",
) -> None:
    """Two layouts of one recipe: every step's loss within :data:`BF16_LOSS`, the first step's
    gradients per element within the recipe's bound (``RECIPE_PRECISION``), the parameters after
    the steps in learning-rate units (a skipped or doubled update fails)."""
    prec = RECIPE_PRECISION[precision]
    for t, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        assert_scalar_close(a, b, f"{what}{precision} loss of step {t}", BF16_LOSS)
    # each gradient's floor at its module's scale or the largest partial it was summed from
    # (:func:`_partial_peaks`), whichever is larger: the partials' roundings are that large
    partials = {**got.get("partials", {})}
    for n, v in want.get("partials", {}).items():
        partials[n] = max(partials.get(n, 0.0), v)
    assert_tensors_close(got["grads"], want["grads"], f"{what}{precision} grad ", prec, partials)
    grads = {**want["grads"], **{n: want["grads"][a] for n, a in want["tied"].items() if a in want["grads"]}}
    assert_params_close(
        got["params"],
        want["params"],
        lr=lr,
        steps=len(want["losses"]),
        grads=grads,
        what=f"{what}{precision} ",
        precision=prec,
        betas=betas,
        eps=eps,
    )
