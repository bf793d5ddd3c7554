"""The CPU variant of the GPU suite's weight and resume checks (``tests/weight_checks.py``, which
``tests/gpu/test_gpu_runs.py`` runs on CUDA): the same run (``ddp`` tower, ``megatron_tp`` LLM,
the bf16 recipe with fp32 masters, 2 steps, a checkpoint after each) on gloo, against the HF
model's float32 training with its own gradients; the resume from step 1 against the
uninterrupted run. Then the faults the checks exist for, each of which must fail them:

- no optimizer step at all (the initial weights in place of the trained ones): passed the old
  check (``grads=None``, the bf16 storage bound), asserted here too;
- one update missing (the weights after step 1 in place of those after step 2);
- a resume that lost its checkpoint's step (the same weights in place of the resumed run's).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("disagg_llm_tp")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import weight_checks as W  # noqa: E402

from disagg.testing.tolerance import BF16, BF16_COMPUTE, assert_params_close  # noqa: E402

STEPS = 2
DDP = {"strategy": "ddp"}
TP = {"strategy": "megatron_tp"}


@pytest.fixture(scope="module")
def runs(ray_local, tmp_path_factory):
    from e2e_run import train

    from disagg.cli.make_tiny import make_tiny
    from disagg.runtime.actor.state import read_module_state

    root = tmp_path_factory.mktemp("weights")
    tiny = make_tiny(root / "tiny", ["qwen2_5_vl"], train_per_class=1, eval_per_class=1, image_size=56)
    full = W.run_config(tiny, root / "full", DDP, TP, "cpu", "bf16", STEPS, checkpoint__every=1)
    ref = W.hf_reference(full, STEPS)
    losses, weights = train(full)
    ckpt = root / "full" / "checkpoints" / "step-1"
    step1 = {m: read_module_state(ckpt, m)[0] for m in ("vision", "llm")}
    resumed = W.run_config(
        tiny, root / "resumed", DDP, TP, "cpu", "bf16", STEPS, checkpoint__resume_from=str(ckpt)
    )
    got_losses, got_weights = train(resumed)
    return {
        "cfg": full,
        "ref": ref,
        "losses": losses,
        "weights": weights,
        "step1": step1,
        "resumed_losses": got_losses,
        "resumed": got_weights,
    }


def test_bf16_run_matches_the_hf_reference_with_its_gradients(runs):
    W.assert_losses_match(runs["losses"], runs["ref"], BF16, "cpu bf16 ")
    W.assert_weights_match(runs["weights"], runs["ref"], STEPS, runs["cfg"].train, BF16_COMPUTE, "cpu bf16 ")
    W.assert_weights_match(runs["step1"], runs["ref"], 1, runs["cfg"].train, BF16_COMPUTE, "cpu bf16 ")


def test_resume_matches_the_uninterrupted_run(runs):
    W.assert_losses_match(runs["resumed_losses"][-1:], _last(runs["ref"]), BF16, "resumed ")
    W.assert_resume_matches(
        runs["resumed"], runs["weights"], runs["ref"], STEPS, runs["cfg"].train, BF16_COMPUTE, "resumed "
    )


def _last(ref: W.Reference) -> W.Reference:
    return W.Reference(ref.losses[-1:], ref.states[-1:], ref.grads[-1:], ref.initial)


def test_the_checks_fail_on_injected_faults(runs):
    ref, train = runs["ref"], runs["cfg"].train
    initial = {m: {k: ref.initial[m][k] for k in runs["weights"][m]} for m in ("vision", "llm")}
    # no optimizer step: the old check (no gradients, the bf16 storage bound) let it through
    for m in ("vision", "llm"):
        assert_params_close(
            initial[m], runs["weights"][m], lr=train.lr, steps=STEPS, grads=None, precision=BF16
        )
    with pytest.raises(AssertionError):
        W.assert_weights_match(initial, ref, STEPS, train, BF16_COMPUTE, "no step: ")
    with pytest.raises(AssertionError):  # one update missing
        W.assert_weights_match(runs["step1"], ref, STEPS, train, BF16_COMPUTE, "an update missing: ")
    with pytest.raises(AssertionError):  # a resume that lost the checkpoint's step
        W.assert_resume_matches(runs["step1"], runs["weights"], ref, STEPS, train, BF16_COMPUTE, "lost: ")
