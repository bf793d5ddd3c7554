"""megatron_tp under the ``train.precision`` recipes: TP 2 with sequence parallelism equals TP 1
(one process) under the same recipe over 5 steps (``disagg.testing.recipes``: losses within 5
bf16 epsilons, first-step gradients per element within the recipe's bound, parameters in
learning-rate units; a skipped or doubled update fails), the weights, masters, gradients and
AdamW state in the recipe's dtypes, and the state bytes each rank measures equal
``Recipe.state_bytes_per_element`` for every element it holds."""

from __future__ import annotations

import pytest
from dropout_cases import BF16_OPTIM
from recipe_cases import RECIPES, tp_recipe_rank
from tp_cases import make_batch

from disagg.interfaces import RECIPES as TABLE
from disagg.testing.dist import run_ranks
from disagg.testing.ranks import loads
from disagg.testing.recipes import assert_same_recipe, expected_state_bytes, gather_single_rank, held_dtypes
from disagg_llm_tp.families.qwen2 import Qwen2Family


@pytest.fixture(scope="module")
def recipe_case(tiny_dirs):
    path = tiny_dirs["qwen2"]
    samples, embeds = make_batch(Qwen2Family(path), n_samples=4)
    results = [loads(b) for b in run_ranks(tp_recipe_rank, 2, path, samples, embeds)]
    return gather_single_rank(results, lambda k: k[0] == "tp1")


def _compare(got: dict, want: dict, precision: str) -> None:
    assert_same_recipe(
        got, want, precision, lr=BF16_OPTIM.lr, betas=BF16_OPTIM.betas, eps=BF16_OPTIM.eps, what="tp2-sp "
    )


@pytest.mark.parametrize("precision", RECIPES)
def test_tp2_sp_equals_tp1_under_the_recipe(recipe_case, precision):
    got, want = recipe_case[0][("tp2", precision)], recipe_case[0][("tp1", precision)]
    for res in (got, want, recipe_case[1][("tp2", precision)]):
        held = tuple(res[k] for k in ("weight_dtypes", "param_dtypes", "grad_dtypes", "state_dtypes"))
        assert held == held_dtypes(precision), held
        assert res["embed_grad_dtypes"] == {TABLE[precision].weights}  # sent back in the compute dtype
    _compare(got, want, precision)


@pytest.mark.parametrize("wrong", ["skipped", "applied twice"])
@pytest.mark.parametrize("precision", RECIPES)
def test_a_wrong_update_fails_the_comparison(recipe_case, precision, wrong):
    got, want = recipe_case[0][("tp2", precision)], recipe_case[0][("tp1", precision)]
    p0, factor = got["initial"], (0.0 if wrong == "skipped" else 2.0)
    bad = {
        n: (p0[n].double() + factor * (p.double() - p0[n].double())).to(p.dtype)
        for n, p in got["params"].items()
    }
    with pytest.raises(AssertionError, match="lr-units"):
        _compare({**got, "params": bad}, want, precision)


@pytest.mark.parametrize("precision", ["fp32", *RECIPES])
def test_state_bytes_per_element_equal_the_recipe(recipe_case, precision):
    """Measured on each TP rank: parameters + masters + gradients + AdamW moments =
    ``Recipe.state_bytes_per_element`` x the elements it holds (plus AdamW's step counts)."""
    for r in recipe_case:
        res = r[("tp2", precision)]
        assert res["frozen_elements"] == res["idle_elements"] == 0 and res["stepped_elements"] > 0
        assert res["state_bytes"] == expected_state_bytes(res, precision), (precision, res["state_bytes"])
        per = (res["state_bytes"] - res["scalar_bytes"]) / res["stepped_elements"]
        assert per == TABLE[precision].state_bytes_per_element()
