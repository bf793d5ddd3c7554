"""The vision tower under the ``train.precision`` recipes: ``ulysses`` at degree 2, ``ulysses``
with FSDP2-sharded state (``shard: parameters``) at degree 2 (``bf16``: also ZeRO-1,
``shard: optimizer``, over the fp32 masters) and ``ddp`` over 2 uneven replicas
each equal the same strategy at degree 1 (one process) under the same recipe over 5 steps
(``disagg.testing.recipes``: the loss 0.5 ||output - target||^2 to fixed random targets at the
output's scale, positive at every step (measured 0.337 -> 0.196 over the 5 steps), within 5 bf16 epsilons,
first-step gradients per element within the recipe's bound, parameters in learning-rate units;
a skipped or doubled update fails); weights, masters, gradients and AdamW state are held in the
recipe's dtypes; ulysses' measured state bytes equal ``Recipe.state_bytes_per_element``."""

from __future__ import annotations

import pytest
import torch
from recipe_cases import OPTIM, RECIPES, recipe_rank

from disagg.interfaces import RECIPES as TABLE
from disagg.kit import sharding as sharded
from disagg.testing.dist import run_ranks
from disagg.testing.ranks import loads
from disagg.testing.recipes import (
    STEPS,
    assert_same_recipe,
    encoder_targets,
    expected_state_bytes,
    gather_single_rank,
    held_dtypes,
)
from disagg_vision_sp.families.llava import LlavaVision
from disagg_vision_sp.testing import random_images

SAMPLES = [[(42, 28), (28, 28)], [(56, 42)], [(28, 42)]]
LAYOUTS = [("ulysses", "ulysses"), ("ulysses-fsdp", "ulysses"), ("ddp", "ddp")]  # (degree 2, degree 1)


@pytest.fixture(scope="module")
def recipe_case(tiny_llava):
    family = LlavaVision(tiny_llava)
    inputs = [family.preprocess(random_images(s, seed=i)) for i, s in enumerate(SAMPLES)]
    targets = encoder_targets(family, inputs)
    results = [loads(b) for b in run_ranks(recipe_rank, 2, str(tiny_llava), inputs, targets)]
    return gather_single_rank(results, lambda k: k[1] == 1)


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


def test_a_loss_that_is_not_positive_is_refused(recipe_case):
    """A relative bound on a signed loss (one AdamW drives through zero) means nothing: refused."""
    got, want = recipe_case[0][("ulysses", 2, "bf16")], recipe_case[0][("ulysses", 1, "bf16")]
    signed = [-x for x in want["losses"]]
    with pytest.raises(AssertionError, match="not positive"):
        _compare({**got, "losses": signed}, {**want, "losses": signed}, "bf16", "ulysses x2 ")


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


@pytest.mark.parametrize("precision", RECIPES)
def test_fsdp_parameters_bytes_equal_the_analytic_model(recipe_case, tiny_llava, precision):
    """``shard: parameters`` at degree 2: every step's all-gather and reduce-scatter bytes and
    calls the rank's counter saw (FSDP2's own collectives, through the counted comms) equal
    ``sharded.comm``: per unit that runs (the tower's blocks up to ``vision_feature_layer`` +
    the root) one all-gather of the rank's shard in the compute dtype for the forward and one
    for the backward, one reduce-scatter of the padded gradients (the tensors that get one) in
    the recipe's gradient dtype. Measured: 50,816 B gathered and 50,688 B (``bf16``, fp32
    gradients) / 25,344 B (``bf16-pure``) reduce-scattered per rank and step."""
    family = LlavaVision(tiny_llava)
    depth = LlavaVision.planning_shape(family.config().to_dict()).depth  # the blocks that run
    unused = tuple(f".layers.{b}." for b in range(depth, family.config().vision_config.num_hidden_layers))
    gathered = {
        n: tuple(p.shape)
        for n, p in family.build(torch.float32).named_parameters()
        if not any(u in n for u in unused)
    }
    with_grad = recipe_case[0][("ulysses", 1, precision)]["grads"]  # the reference's: what gets a gradient
    recipe, units = TABLE[precision], depth + 1
    gather, gather_calls = sharded.comm(
        list(gathered.values()), "parameters", 2, 1, units, recipe.weights.itemsize
    )
    scatter, scatter_calls = sharded.comm(
        [gathered[n] for n in with_grad],
        "parameters",
        2,
        1,
        units,
        recipe.weights.itemsize,
        recipe.grads.itemsize,
    )
    want = (
        {"all_gather": gather["all_gather"], "reduce_scatter": scatter["reduce_scatter"]},
        {"all_gather": gather_calls["all_gather"], "reduce_scatter": scatter_calls["reduce_scatter"]},
    )
    for r in recipe_case:
        steps = r[("ulysses-fsdp", 2, precision)]["comm"]
        assert len(steps) == STEPS
        for t, (got_bytes, got_calls) in enumerate(steps):
            got = {k: got_bytes.get(k, 0) for k in want[0]}, {k: got_calls.get(k, 0) for k in want[1]}
            assert got == want, (t, got_bytes, got_calls)
