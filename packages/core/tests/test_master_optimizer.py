"""The ``bf16`` masters live in the optimizer (:class:`disagg.kit.masters.MasterOptimizer`), not
in a hook that rewrites strategy classes: a strategy that overrides ``step`` gets its own
``step`` called, as written, and the optimizer it steps still updates the float32 masters and
writes the bf16 weights back."""

from __future__ import annotations

import pytest
import torch

from disagg.builtin.ddp import DDPStrategy
from disagg.interfaces import OptimSpec
from disagg.kit.masters import MasterOptimizer
from disagg.testing import ranks
from disagg.testing.tolerance import assert_exact
from disagg.testing.toy import ToyLMFamily, make_toy_dirs, toy_samples

OPTIM = OptimSpec(lr=3e-3, weight_decay=0.01)


def own_step(self: OwnStep, clip_coef: float) -> None:
    """Steps the optimizer itself (no ``super().step``), and counts its calls."""
    self.own_steps = getattr(self, "own_steps", 0) + 1
    assert self.optimizer is not None
    self.optimizer.step()


class OwnStep(DDPStrategy):
    name = "own_step"
    own_steps = 0
    step = own_step  # defined outside, so that a class-rewriting hook would show


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return make_toy_dirs(tmp_path_factory.mktemp("toy"), hidden=32)[1]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_overridden_step_is_the_step_that_runs(lm_dir, precision):
    ctx = ranks.rank_context("llm", 0, 1, 1, precision=precision)
    strat = ranks.strategy_rank(OwnStep, ToyLMFamily(lm_dir), ctx, optim=OPTIM)
    assert OwnStep.step is own_step  # the class you wrote is the class that runs
    assert isinstance(strat.optimizer, MasterOptimizer) == (precision == "bf16")
    batch = [s["llm"] for s in toy_samples(4, seed=0, text_only_every=1)]
    total = sum(int((s["labels"][1:] != -100).sum()) for s in batch)
    with strat.masters():
        before = {n: p.detach().clone() for n, p in strat.module.named_parameters()}
    ranks.loss_and_backward(strat, 0, batch, [{} for _ in batch], 1.0 / total)
    ranks.finish_step(strat)
    assert strat.own_steps == 1
    with strat.masters():
        after = {n: p.detach().clone() for n, p in strat.module.named_parameters()}
    assert {t.dtype for t in after.values()} == {torch.float32}  # the masters (fp32: the weights)
    assert all(not torch.equal(after[n], before[n]) for n in after), "every parameter stepped"
    # the weights the forward uses are the stepped masters, rounded: written back by the optimizer
    for n, p in strat.module.named_parameters():
        assert_exact(p.detach(), after[n].to(p.dtype), f"weight {n}")
