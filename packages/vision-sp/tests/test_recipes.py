"""The vision tower under the ``train.precision`` recipes: ``ulysses`` at degree 2, ``ulysses``
with FSDP2-sharded state (``shard: parameters``) at degree 2 (``bf16``: also ZeRO-1,
``shard: optimizer``, over the fp32 masters) and ``ddp`` over 2 uneven replicas
each equal the same strategy at degree 1 (one process) under the same recipe over 5 steps
(``disagg.testing.recipes``: the loss proxy sum <output, upstream grad> within 5 bf16 epsilons,
first-step gradients per element within the recipe's bound, parameters in learning-rate units;
a skipped or doubled update fails); weights, masters, gradients and AdamW state are held in the
recipe's dtypes; ulysses' measured state bytes equal ``Recipe.state_bytes_per_element``."""

from __future__ import annotations

import pytest
import torch
from recipe_cases import OPTIM, RECIPES, recipe_rank

from disagg.interfaces import RECIPES as TABLE
from disagg.testing.dist import run_ranks
from disagg.testing.ranks import loads
from disagg.testing.recipes import assert_same_recipe, expected_state_bytes, held_dtypes
from disagg_vision_sp.families.llava import LlavaVision
from disagg_vision_sp.testing import random_images, upstream_grads

SAMPLES = [[(42, 28), (28, 28)], [(56, 42)], [(28, 42)]]
LAYOUTS = [("ulysses", "ulysses"), ("ulysses-fsdp", "ulysses"), ("ddp", "ddp")]  # (degree 2, degree 1)


@pytest.fixture(scope="module")
def recipe_case(tiny_llava):
    family = LlavaVision(tiny_llava)
    inputs = [family.preprocess(random_images(s, seed=i)) for i, s in enumerate(SAMPLES)]
    grads = upstream_grads(family, inputs)
    return [loads(b) for b in run_ranks(recipe_rank, 2, str(tiny_llava), inputs, grads)]


def _compare(got: dict, want: dict, precision: str, what: str) -> None:
    assert_same_recipe(got, want, precision, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, what=what)


CASES = [(lay, one, p) for p in RECIPES for lay, one in LAYOUTS] + [("ulysses-zero1", "ulysses", "bf16")]


@pytest.mark.parametrize("layout,single,precision", CASES)
def test_degree_2_equals_degree_1_under_the_recipe(recipe_case, layout, single, precision):
    got, want = recipe_case[0][(layout, 2, precision)], recipe_case[0][(single, 1, precision)]
    weights = TABLE[precision].weights
    for res in (got, want, recipe_case[1][(layout, 2, precision)]):
        assert res["out_dtypes"] <= {weights}  # rows go to the LLM in the compute dtype
        held = tuple(res[k] for k in ("weight_dtypes", "param_dtypes", "grad_dtypes", "state_dtypes"))
        if layout == "ulysses-fsdp" and res is not want and precision == "bf16":
            # FSDP2's policy: fp32 shards gathered in bf16 for compute, no separate bf16 copy held
            assert held == ({torch.float32},) * 4, held
        else:
            assert held == held_dtypes(precision), held
    _compare(got, want, precision, f"{layout} x2 ")


@pytest.mark.parametrize("wrong", ["skipped", "applied twice"])
@pytest.mark.parametrize("precision", RECIPES)
def test_a_wrong_update_fails_the_comparison(recipe_case, precision, wrong):
    got, want = recipe_case[0][("ulysses", 2, precision)], recipe_case[0][("ulysses", 1, precision)]
    p0, factor = got["initial"], (0.0 if wrong == "skipped" else 2.0)
    bad = {
        n: (p0[n].double() + factor * (p.double() - p0[n].double())).to(p.dtype)
        for n, p in got["params"].items()
    }
    with pytest.raises(AssertionError, match="lr-units"):
        _compare({**got, "params": bad}, want, precision, "ulysses x2 ")


@pytest.mark.parametrize("precision", ["fp32", *RECIPES])
def test_ulysses_state_bytes_per_element_equal_the_recipe(recipe_case, precision):
    """Measured on each rank of ulysses 2: parameters + masters + gradients + AdamW moments =
    ``Recipe.state_bytes_per_element`` x the elements it holds (plus AdamW's step counts)."""
    for r in recipe_case:
        res = r[("ulysses", 2, precision)]
        assert res["frozen_elements"] == 0 and res["stepped_elements"] > 0
        assert res["state_bytes"] == expected_state_bytes(res, precision), (precision, res["state_bytes"])
        if not res["idle_elements"]:  # every element stepped: bytes per element are the recipe's
            per = (res["state_bytes"] - res["scalar_bytes"]) / res["stepped_elements"]
            assert per == TABLE[precision].state_bytes_per_element()
