"""``zero`` under the ``train.precision`` recipes, in DeepSpeed's own mode for each
(``disagg_zero.dsconfig.PRECISION_SECTIONS``): stages 1, 2 and 3 over 2 ranks (uneven samples)
equal the same stage on 1 rank (one process) under the same recipe over 5 steps
(``disagg.testing.recipes``: the LM's positive loss within 5 bf16 epsilons, first-step
gradients per element within the recipe's bound, parameters in learning-rate units; a skipped
or doubled update fails); DeepSpeed holds the recipe's dtypes (``bf16``: bf16 weights, fp32
masters, fp32 gradients, fp32 moments; ``bf16-pure``: all bf16) and the embedding gradients go
back in the compute dtype; the masters start from the loaded fp32 weights; and every rank's
measured state bytes equal ``cost.zero_state_bytes`` under the recipe, within AdamW's step
counts. Run in ``test_zero_uneven``'s spawn (``conftest.py``), not one of its own."""

from __future__ import annotations

import pytest
import torch
from zero_recipe_cases import OPTIM, RECIPES, STAGES

from disagg.interfaces import RECIPES as TABLE
from disagg.testing.ranks import loads
from disagg.testing.recipes import assert_same_recipe, held_dtypes
from disagg.testing.tolerance import BF16_COMPUTE, BF16_LOSS, assert_scalar_close
from disagg.testing.toy import ToyLMFamily
from disagg_zero.cost import zero_state_bytes

CASES = [(s, p) for s in STAGES for p in RECIPES]


@pytest.fixture(scope="module")
def recipe_case(uneven_spawn: dict) -> list[dict]:
    """Per rank of the 2-rank group, its results; the 1-rank runs (made by either process) in
    both. Run at the end of the uneven tests' spawn (``conftest.py``)."""
    got = [loads(r["recipes"]) for r in uneven_spawn["ranks"]]
    ones = {k: v for r in got for k, v in r.items() if isinstance(k, tuple) and k[1] == 1}
    return [{**r, **ones, "dir": uneven_spawn["lm"]} for r in got]


def _compare(got: dict, want: dict, precision: str, stage: int) -> None:
    assert_same_recipe(
        got, want, precision, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, what=f"zero {stage} x2 "
    )


@pytest.mark.parametrize("stage,precision", CASES)
def test_two_ranks_equal_one_under_the_recipe(recipe_case, stage: int, precision: str) -> None:
    got, want = recipe_case[0][(stage, 2, precision)], recipe_case[0][(stage, 1, precision)]
    weights = TABLE[precision].weights
    for res in (got, want, recipe_case[1][(stage, 2, precision)]):
        held = tuple(res[k] for k in ("weight_dtypes", "param_dtypes", "grad_dtypes", "state_dtypes"))
        assert held == held_dtypes(precision), (res["optimizer"], held)
        assert res["embed_grad_dtypes"] == {weights}  # sent back to the encoder in the compute dtype
        assert min(res["losses"]) > 10  # the CE sum stays far from 0: a relative bound means something
    # DeepSpeed's own optimizer for the mode: stage 1 under bf16 is its BF16_Optimizer
    assert (
        got["optimizer"]
        == {
            1: "BF16_Optimizer" if precision == "bf16" else "DeepSpeedZeroOptimizer",
            2: "DeepSpeedZeroOptimizer",
            3: "DeepSpeedZeroOptimizer_Stage3",
        }[stage]
    )
    _compare(got, want, precision, stage)


@pytest.mark.parametrize("stage,precision", CASES)
def test_masters_start_from_the_loaded_fp32_weights(recipe_case, stage: int, precision: str) -> None:
    """The full form before any step is the checkpoint's: under ``bf16`` the fp32 masters equal
    the fp32 weights exactly (DeepSpeed would start them from its bf16 cast; ``runtime.seed_masters``
    copies the loaded values in, stage 3 from the partitions ``build.py`` read), under
    ``bf16-pure`` the weights rounded to bf16 once."""
    ref = ToyLMFamily(recipe_case[0]["dir"]).build().state_dict()
    for world in (2, 1):
        initial = recipe_case[0][(stage, world, precision)]["initial"]
        assert sorted(initial) == sorted(ref)
        for name, want in ref.items():
            have = initial[name]
            if precision == "bf16":
                assert have.dtype == torch.float32 and torch.equal(have, want), name
            else:
                assert torch.equal(have.float(), want.to(torch.bfloat16).float()), name


@pytest.mark.parametrize("wrong", ["skipped", "applied twice"])
@pytest.mark.parametrize("stage,precision", [(1, "bf16"), (3, "bf16-pure")])
def test_a_wrong_update_fails_the_comparison(recipe_case, stage: int, precision: str, wrong: str) -> None:
    got, want = recipe_case[0][(stage, 2, precision)], recipe_case[0][(stage, 1, precision)]
    p0, factor = got["initial"], (0.0 if wrong == "skipped" else 2.0)
    bad = {
        n: (p0[n].double() + factor * (p.double() - p0[n].double())).to(p.dtype)
        for n, p in got["params"].items()
    }
    with pytest.raises(AssertionError, match="lr-units"):
        _compare({**got, "params": bad}, want, precision, stage)


@pytest.mark.parametrize("stage,precision", CASES)
def test_state_bytes_equal_the_estimate(recipe_case, stage: int, precision: str) -> None:
    """Measured on each rank after the last step: DeepSpeed's weights, masters, gradients and
    AdamW moments equal ``cost.zero_state_bytes`` under the recipe (persistence threshold 0:
    every tensor partitioned in stage 3) plus MaskedAdamW's step counts; per element that
    is, over n ranks: stages 1-2 ``w + (master + moments)/n`` (+ stage 1 under ``bf16``: the
    whole fp32 gradient), stage 3 ``(w + master + gradient + moments)/n``."""
    per_element = {  # bytes per element at 1 rank: the recipe's figures, with DeepSpeed's master copy
        "bf16": {1: 18, 2: 14, 3: 18},
        "bf16-pure": {1: 8, 2: 8, 3: 10},
    }[precision][stage]
    for world, results in ((2, recipe_case), (1, recipe_case[:1])):  # the 1-rank run is in both
        for res in (r[(stage, world, precision)] for r in results):
            want = zero_state_bytes(res["numels"], stage, world, 0, precision=precision)
            got = res["state_bytes"]
            # beyond the estimate: MaskedAdamW's step counts and DeepSpeed's own scalars (its
            # norm, a flag: under 16 bytes)
            assert 0 <= got - want - res["step_bytes"] < 16, (stage, world, precision, got, want)
            if world == 1:
                assert want == per_element * sum(res["numels"]), (want, sum(res["numels"]))


@pytest.mark.parametrize("stage,precision", CASES)
def test_gradients_are_reduced_in_the_recipes_dtype(recipe_case, stage: int, precision: str) -> None:
    """The bytes DeepSpeed's gradient reduction sent in a whole step (the 4th, counted by
    ``disagg_zero.comm``) are the recipe's gradient dtype's: ``bf16`` reduces fp32 (4 bytes per
    element; DeepSpeed's own default under bf16 would send 2, its ``BF16_Optimizer`` at stage 1
    included), ``bf16-pure`` bf16 (2). At 2 ranks a ring all-reduce sends the whole gradient once
    (stages 1-2, plus the agreement and norm scalars), a reduce-scatter the other rank's half
    (stage 3, every tensor partitioned, ``cost.zero_comm`` exactly)."""
    from disagg.interfaces.cost import Workload
    from disagg_zero.cost import zero_comm

    grad = TABLE[precision].grads.itemsize
    for r in recipe_case:
        res = r[(stage, 2, precision)]
        numels, sent = res["numels"], res["comm"][3][0]  # the 4th step's bytes by kind (the kit's)
        if stage < 3:
            scalars = 8 * (len(numels) + 1) + 16  # the agreement flags, DeepSpeed's norm scalars
            assert grad * sum(numels) <= sent["all_reduce"] <= grad * sum(numels) + scalars, sent
            continue
        w = Workload(degree=1, replicas=2, seq_len=1, samples=2, precision=precision)
        want = zero_comm(numels, 3, w, 0, [0] * len(numels), grad_bytes=w.grad_bytes)["reduce_scatter"]
        assert sent["reduce_scatter"] == want == grad * sum(-(-k // 2) for k in numels), sent


@pytest.mark.parametrize("stage", STAGES)
def test_two_microbatches_equal_one_backward_under_bf16(recipe_case, stage: int) -> None:
    """Each rank's samples split over 2 backwards before each step (the other recipe cases take
    one): the same losses, first-step gradients and parameters as the 1-rank, 1-backward run under
    ``bf16``, and every step's grad norm and loss within the recipe's bounds of the ``fp32`` run
    (``zero`` in fp32 equals the Hugging Face model: ``test_zero_equivalence``). Stage 1 is
    DeepSpeed's ``BF16_Optimizer``, whose fp32 accumulation a single backward never exercises: it
    re-added the 1st microbatch's gradient (norm 5.46 against fp32's 3.25) until the strategy ran
    DeepSpeed's backward prologue before each backward."""
    fp32 = recipe_case[0][(1, 2, "fp32")]
    for r in recipe_case:  # the norm and loss are the group's: the same on each rank
        got = r[(stage, 2, "bf16", 2)]
        _compare(got, recipe_case[0][(stage, 1, "bf16")], "bf16", stage)
        what = f"zero {stage} bf16 x2 ranks x2 microbatches against fp32, step "
        for t, (norm, want) in enumerate(zip(got["norms"], fp32["norms"], strict=True)):
            assert_scalar_close(norm, want, f"{what}{t} grad norm", BF16_COMPUTE)
        for t, (loss, want) in enumerate(zip(got["losses"], fp32["losses"], strict=True)):
            assert_scalar_close(loss, want, f"{what}{t} loss", BF16_LOSS)
