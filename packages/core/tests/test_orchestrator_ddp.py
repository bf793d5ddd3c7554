"""ddp through the real orchestrator equals the single-process model (DESIGN.md contract)."""

from __future__ import annotations

import pytest
import torch

from disagg.builtin.ddp import DDPStrategy
from disagg.interfaces import OptimSpec, StrategyOptions
from disagg.runtime.groups import GroupSpec
from disagg.runtime.orchestrator import Orchestrator
from disagg.testing.reference import ReferenceModel, assert_close_dicts
from disagg.testing.toy import ToyEncoderFamily, ToyLMFamily, make_toy_dirs, put_samples, toy_samples

STEPS = 3
BATCH = 6


@pytest.fixture(scope="module")
def toy_dirs(tmp_path_factory):
    return make_toy_dirs(tmp_path_factory.mktemp("toy"))


def _specs(toy_dirs, enc_replicas, llm_replicas, optims):
    enc, lm = toy_dirs
    out = []
    if "vision" in optims:
        out.append(GroupSpec("vision", ToyEncoderFamily(enc), DDPStrategy, StrategyOptions(), 1, enc_replicas,
                             optims["vision"]))
    out.append(GroupSpec("llm", ToyLMFamily(lm), DDPStrategy, StrategyOptions(), 1, llm_replicas, optims["llm"]))
    return out


# Adam divides by sqrt(v) + eps: with the default eps=1e-8 a gradient element of
# ~1e-9 (pure rounding noise) moves its parameter by a full learning rate, so
# two correct summation orders disagree at 1e-4. eps=1e-3 keeps the update
# Lipschitz in the gradient (|dp| <= lr/eps * |dg|) and the 1e-5 bound meaningful.
EPS = 1e-3


def _optims(total=STEPS, vision_lr=1e-2, llm_lr=2e-2, frozen=()):
    specs = {
        "vision": OptimSpec(lr=vision_lr, weight_decay=0.1, eps=EPS, total_steps=total, scheduler="linear",
                            warmup_steps=1),
        "llm": OptimSpec(lr=llm_lr, weight_decay=0.0, eps=EPS, total_steps=total),
    }
    return {m: (None if m in frozen else s) for m, s in specs.items()}


def _run(toy_dirs, enc_replicas, llm_replicas, *, clip=0.5, microbatches=1, frozen=(), vision_lr=1e-2):
    optims = _optims(frozen=frozen, vision_lr=vision_lr)
    batches = [toy_samples(BATCH, seed=10 + s, text_only_every=4) for s in range(STEPS)]
    ref = ReferenceModel({"vision": ToyEncoderFamily(toy_dirs[0]), "llm": ToyLMFamily(toy_dirs[1])}, optims)
    orch = Orchestrator(_specs(toy_dirs, enc_replicas, llm_replicas, optims), microbatches=microbatches,
                        clip_grad_norm=clip)
    try:
        for s, samples in enumerate(batches):
            want = ref.step(samples, clip)
            got = orch.step(put_samples(samples, start=s * BATCH))
            assert got.loss == pytest.approx(want.loss, rel=1e-5)
            assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-5)
            for m in want.grads:
                assert_close_dicts(orch.full_grads(m), want.grads[m], what=f"step {s} {m} grad ")
            for m in want.params:
                assert_close_dicts(orch.full_state_dict(m), want.params[m], what=f"step {s} {m} param ")
        return orch.placement(), got
    finally:
        orch.shutdown()


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_ddp_replicas_equal_single_process(ray_local, toy_dirs, replicas):
    _run(toy_dirs, replicas, replicas)


@pytest.mark.parametrize("enc_replicas,llm_replicas", [(2, 1), (1, 2)])
def test_routing_between_different_replica_counts(ray_local, toy_dirs, enc_replicas, llm_replicas):
    _run(toy_dirs, enc_replicas, llm_replicas)


def test_gradient_accumulation_over_microbatches(ray_local, toy_dirs):
    _run(toy_dirs, 2, 1, microbatches=3)


def test_frozen_encoder_does_not_change_while_llm_trains(ray_local, toy_dirs):
    before = ToyEncoderFamily(toy_dirs[0]).build().state_dict()
    optims = _optims(frozen=("vision",))
    orch = Orchestrator(_specs(toy_dirs, 1, 1, optims), clip_grad_norm=1.0)
    try:
        llm_before = orch.full_state_dict("llm")
        orch.step(put_samples(toy_samples(BATCH, seed=3)))
        assert_close_dicts(orch.full_state_dict("vision"), before, rtol=0, atol=0, what="frozen vision ")
        changed = [k for k, v in orch.full_state_dict("llm").items() if not torch.equal(v, llm_before[k])]
        assert changed, "the LLM should have trained"
    finally:
        orch.shutdown()
    # equivalence with a frozen module too (no optimizer, gradients still flow through it)
    _run(toy_dirs, 1, 2, frozen=("vision",))


def test_per_module_learning_rates_take_effect(ray_local, toy_dirs):
    optims = _optims(vision_lr=1e-3)
    orch = Orchestrator(_specs(toy_dirs, 1, 1, optims), clip_grad_norm=None)
    try:
        res = orch.step(put_samples(toy_samples(BATCH, seed=4)))
        # warmup 1 then linear decay for vision; constant for the LLM
        assert res.groups["vision"]["lr"] == pytest.approx(1e-3 * (STEPS - 1) / (STEPS - 1))
        assert res.groups["llm"]["lr"] == pytest.approx(2e-2)
    finally:
        orch.shutdown()
    _run(toy_dirs, 1, 1, vision_lr=1e-3, clip=None)
