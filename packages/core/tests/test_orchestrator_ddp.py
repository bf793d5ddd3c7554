"""ddp through the real orchestrator equals the single-process model (DESIGN.md contract)."""

from __future__ import annotations

import pytest
import torch

from disagg.builtin.ddp import DDPStrategy
from disagg.interfaces import OptimSpec, StrategyOptions
from disagg.runtime.groups import GroupSpec
from disagg.runtime.orchestrator import Orchestrator
from disagg.testing.reference import ReferenceModel
from disagg.testing.tolerance import assert_exact, assert_scalar_close, assert_tensors_close
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
        out.append(
            GroupSpec(
                "vision",
                ToyEncoderFamily(enc),
                DDPStrategy,
                StrategyOptions(),
                1,
                enc_replicas,
                optims["vision"],
            )
        )
    out.append(
        GroupSpec("llm", ToyLMFamily(lm), DDPStrategy, StrategyOptions(), 1, llm_replicas, optims["llm"])
    )
    return out


# Adam divides by sqrt(v) + eps: with the default eps=1e-8 a gradient element of
# ~1e-9 (pure rounding noise) moves its parameter by a full learning rate, so
# two correct summation orders disagree at 1e-4. eps=1e-3 keeps the update
# Lipschitz in the gradient (|dp| <= lr/eps * |dg|) and the 1e-5 bound meaningful.
EPS = 1e-3


def _optims(total=STEPS, vision_lr=1e-2, llm_lr=2e-2, frozen=()):
    specs = {
        "vision": OptimSpec(
            lr=vision_lr, weight_decay=0.1, eps=EPS, total_steps=total, scheduler="linear", warmup_steps=1
        ),
        "llm": OptimSpec(lr=llm_lr, weight_decay=0.0, eps=EPS, total_steps=total),
    }
    return {m: (None if m in frozen else s) for m, s in specs.items()}


def _reference_greedy(ref: ReferenceModel, samples: list) -> tuple[int, int]:
    """Label tokens the single-process model predicts right (argmax), and label tokens."""
    embeds = [
        {m: f.encode(ref.modules[m], s[m]) for m, f in ref.families.items() if m != "llm" and m in s}
        for s in samples
    ]
    logits, labels = ref.families["llm"].forward(ref.modules["llm"], [s["llm"] for s in samples], embeds)
    mask = labels != -100
    return int((logits.argmax(-1)[mask] == labels[mask]).sum()), int(mask.sum())


def _run(toy_dirs, enc_replicas, llm_replicas, *, clip=0.5, microbatches=1, frozen=(), vision_lr=1e-2):
    optims = _optims(frozen=frozen, vision_lr=vision_lr)
    batches = [toy_samples(BATCH, seed=10 + s, text_only_every=4) for s in range(STEPS)]
    ref = ReferenceModel({"vision": ToyEncoderFamily(toy_dirs[0]), "llm": ToyLMFamily(toy_dirs[1])}, optims)
    initial = {m: {k: v.clone() for k, v in mod.state_dict().items()} for m, mod in ref.modules.items()}
    orch = Orchestrator(
        _specs(toy_dirs, enc_replicas, llm_replicas, optims), microbatches=microbatches, clip_grad_norm=clip
    )
    results = []
    try:
        for s, samples in enumerate(batches):
            want = ref.step(samples, clip)
            got = orch.step(put_samples(samples, start=s * BATCH))
            results.append(got)
            assert_scalar_close(got.loss, want.loss, f"step {s} loss")
            assert_scalar_close(got.grad_norm, want.grad_norm, f"step {s} grad norm")
            for m in want.grads:
                assert_tensors_close(orch.full_grads(m), want.grads[m], f"step {s} {m} grad ")
            for m in want.params:
                ref.assert_params_match(m, orch.full_state_dict(m), what=f"step {s} {m} param ")
        # forward-only evaluation through the groups equals the reference's loss and greedy accuracy
        held_out = toy_samples(BATCH, seed=99, text_only_every=3)
        with torch.no_grad():
            want_loss, _ = ref.loss(held_out)
            want_correct, want_tokens = _reference_greedy(ref, held_out)
        ev = orch.evaluate(put_samples(held_out, start=1000))
        assert_scalar_close(ev["loss"], float(want_loss), "evaluate loss")
        assert ev["label_tokens"] == want_tokens > 0
        assert ev["token_accuracy"] == want_correct / want_tokens, (ev["token_accuracy"], want_correct)
        for m in frozen:  # a frozen module gets no parameter change at all
            assert_exact(orch.full_state_dict(m), initial[m], what=f"frozen {m} ")
        for m in {"vision", "llm"} - set(frozen):
            assert any(not torch.equal(v, initial[m][k]) for k, v in orch.full_state_dict(m).items()), m
        return results
    finally:
        orch.shutdown()


@pytest.mark.parametrize(
    "enc_replicas,llm_replicas,microbatches,frozen",
    [
        (1, 1, 1, ()),
        (2, 2, 1, ()),
        (3, 3, 2, ()),  # replicas 3, with gradient accumulation over 2 microbatches
        (2, 1, 3, ()),  # routing: 2 encoder replicas feed 1 LLM replica
        (1, 2, 1, ("vision",)),  # routing the other way, frozen encoder
        (2, 1, 1, ("llm",)),  # frozen LLM: gradients still flow through it to the encoder
    ],
)
def test_ddp_equals_single_process(ray_local, toy_dirs, enc_replicas, llm_replicas, microbatches, frozen):
    results = _run(toy_dirs, enc_replicas, llm_replicas, microbatches=microbatches, frozen=frozen)
    if not frozen:
        # per-module schedules: vision warms up from 0 over 1 step then decays linearly; the LLM is constant
        assert [r.groups["vision"]["lr"] for r in results] == pytest.approx([0.0, 1e-2, 0.5e-2])
        assert [r.groups["llm"]["lr"] for r in results] == pytest.approx([2e-2] * STEPS)
