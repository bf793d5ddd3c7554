"""The precision-recipe tests' kit (``train.precision``: ``bf16``, ``bf16-pure``): a few steps of
one strategy under one recipe, run as the worker runs them, and the comparison of two layouts of
the same recipe (degree 2 against degree 1) under the tolerance policy.

A strategy's test spawns its ranks once (:func:`disagg.testing.dist.run_ranks`); each rank runs
:func:`recipe_steps` at degree 2 for every recipe, then every rank becomes a one-rank group of
its own (:func:`single_rank_group`) and runs its share of the degree-1 cases
(:func:`single_rank_share`: the ranks split them, so they run side by side), gathered into rank
0's results by :func:`gather_single_rank`: no second spawn.

The compared loss is a sum of non-negative terms (the LM's cross-entropy; an encoder's squared
error to fixed targets, :func:`squared_error_microbatch`), so that a tolerance relative to its
own size is one: a signed proxy such as ``<output, fixed upstream gradient>`` is driven through
zero by AdamW (measured on the tiny LLaVA tower: 0.59 -> -3.1 -> ... -14.7 over the 5 steps),
where a relative bound means nothing. :func:`assert_same_recipe` refuses a loss that is not
positive at every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from disagg.interfaces import RECIPES
from disagg.kit import Strategy
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


def single_rank_share(cases: list[Any], rank: int, world: int) -> list[Any]:
    """This rank's share of the degree-1 ``cases`` (every ``world``-th, from its own rank),
    after it left the spawned group for a group of one (:func:`single_rank_group`)."""
    single_rank_group()
    return cases[rank::world]


def gather_single_rank(results: list[dict[Any, Any]], is_single: Callable[[Any], bool]) -> list[dict]:
    """Rank 0's results with every rank's degree-1 ones (keys ``is_single`` picks) added."""
    for r in results[1:]:
        results[0].update({k: v for k, v in r.items() if is_single(k)})
    return results


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
    each step's counted collectives (``comm``: bytes and calls by kind, as the worker reports
    them; the first step's also count the kit's reads of the merged gradients where a strategy
    gathers them through the counter),
    the parameters after the last step (the full form: masters under ``bf16``), dtypes as held,
    and this rank's state bytes after the last step (before its gradients are dropped), with
    the parameter elements it holds and the bytes of AdamW's scalar step counts."""
    assert strat.module is not None and strat.optimizer is not None
    out: dict[str, Any] = {"losses": [], "initial": ranks.full_state(strat), "comm": []}
    strat.ctx.comm.reset()  # the set-up's collectives are no step's
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
        # what the worker reports for the step: its counted collectives, by kind
        calls = strat.ctx.comm.calls()
        out["comm"].append((strat.ctx.comm.reset(), calls))
    out["params"] = ranks.full_state(strat)
    # a tied weight (lm_head = embed_tokens) is in the state under each name, its gradient under one
    by_id = {id(p): n for n, p in strat.module.named_parameters()}
    out["tied"] = {
        n: by_id[id(t)]
        for n, t in strat.module.state_dict(keep_vars=True).items()
        if isinstance(t, torch.nn.Parameter) and by_id.get(id(t), n) != n
    }
    return out


def encoder_targets(family: Any, inputs: list[dict[str, torch.Tensor]], seed: int = 1) -> list[torch.Tensor]:
    """Fixed targets of the encoder loss ``0.5 * ||output - target||^2``, one per sample: random,
    at the scale (root mean square) of the family's fp32 output at initialisation, so that the
    loss and its gradient ``output - target`` depend on the output as much as on the target."""
    with torch.no_grad():
        module = family.build(torch.float32).eval()
        outs = [family.encode(module, x) for x in inputs]
    rms = float(torch.cat([o.reshape(-1) for o in outs]).double().pow(2).mean().sqrt())
    g = torch.Generator().manual_seed(seed)
    return [rms * torch.randn(o.shape, generator=g) for o in outs]


def squared_error_microbatch(
    inputs: list[dict[str, torch.Tensor]], targets: list[torch.Tensor], seen: dict[str, Any]
) -> Callable[[Strategy], float]:
    """An encoder's :func:`recipe_steps` microbatch: forward, then backward of this rank's part of
    ``0.5 * sum_i ||output_i - target_i||^2`` (its shards' rows: the group's parts add up to the
    whole, a rank whose shard is empty, e.g. a TP peer, adds nothing), returned as a float; the
    shards' dtypes go in ``seen['out_dtypes']``."""

    def microbatch(strat: Strategy) -> float:
        shards = ranks.encode(strat, 0, inputs)
        seen["out_dtypes"] = {s.value.dtype for s in shards}
        diffs = [s.value.float() - t[s.positions] for s, t in zip(shards, targets)]
        ranks.backward(strat, 0, shards, [d.detach() for d in diffs])  # d/d output of the loss
        return float(sum(0.5 * d.detach().double().pow(2).sum() for d in diffs))

    return microbatch


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
    # a relative bound on a loss is one only where the loss is a sum of positive terms (module doc)
    assert all(x > 0 for x in want["losses"]), f"{what}{precision}: losses not positive {want['losses']}"
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
