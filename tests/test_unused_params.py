"""Parameters that never get a gradient are left alone, exactly as the
single-process model leaves them: LLaVA reads the tower's second-to-last
hidden state, so its last layer and post-layernorm get no gradient. With
weight decay on, a zero-filled gradient would still move them (decay, Adam
momentum). Under ``ulysses`` 2 and ``megatron_tp`` 2, each with 2 replicas and
a step where one replica gets no image: the same parameters have gradients as
in the reference at every step, the unused ones stay bit-identical with no
optimizer state, and the rest equal the reference after three AdamW steps.
Also: the vision families classify every parameter for megatron_tp."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

from encoder_steps import (  # noqa: E402
    OPTIM,  # noqa: E402
    reference_steps,
    run_steps,
)

from disagg.testing.tolerance import assert_params_close, assert_scalar_close  # noqa: E402
from disagg_vision_sp.families.llava import LlavaVision  # noqa: E402
from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision  # noqa: E402
from disagg_vision_sp.testing import random_images, upstream_grads  # noqa: E402

SAMPLES = [[(50, 40), (20, 30)], [(64, 64)], [(31, 17)], [(40, 90)]]
# step -> replica -> sample ids; in step 1 replica 1 gets no image at all
SCHEDULE = [[[0, 1], [2, 3]], [[0, 2], []], [[3], [1]]]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = LlavaVision.make_tiny(tmp_path_factory.mktemp("tiny") / "llava")
    family = LlavaVision(path)
    inputs = [family.preprocess(random_images(s, seed=i)) for i, s in enumerate(SAMPLES)]
    grads = upstream_grads(family, inputs)
    initial = {n: p.detach().clone() for n, p in family.build().named_parameters()}
    return family, inputs, grads, initial, reference_steps(family, inputs, grads, SCHEDULE)


def _unused(names) -> list[str]:  # noqa: ANN001
    return [
        n for n in names if n.startswith(("vision_tower.encoder.layers.2.", "vision_tower.post_layernorm."))
    ]


def test_reference_leaves_unused_parameters_alone(case):
    *_, initial, ref = case
    unused = _unused(initial)
    assert len(unused) == 18  # 16 in the last layer, 2 in the post-layernorm
    for present in ref["present"]:
        assert not set(unused) & set(present)
    assert set(ref["with_state"]) == set(initial) - set(unused)
    for n in unused:
        assert torch.equal(ref["params"][n], initial[n]), n


@pytest.mark.parametrize("strategy", ["ulysses", "megatron_tp"])
def test_weight_decay_skips_parameters_without_gradient(case, strategy):
    family, inputs, grads, initial, ref = case
    results = run_steps(strategy, 2, 2, str(family.path), inputs, grads, SCHEDULE)
    unused = _unused(initial)
    for res in results:
        assert res["present"] == ref["present"], "parameters with a gradient differ from the reference"
        for step, (got, want) in enumerate(zip(res["norm_sq"], ref["norm_sq"])):
            assert_scalar_close(got, want, f"step {step} grad_norm_sq")
        assert set(res["with_state"]) == set(ref["with_state"]), (
            "optimizer state for a parameter never updated"
        )
    params = results[0]["params"]
    for n in unused:
        assert torch.equal(params[n], initial[n]), f"{n} moved without a gradient"
    # Every parameter by the policy, none by name: a key bias (softmax ignores it, so its
    # gradient is rounding noise) is bounded per element from its own reference gradient.
    assert_params_close(
        params,
        ref["params"],
        lr=OPTIM.lr,
        steps=len(SCHEDULE),
        grads=ref["grads"],
        what=f"{strategy} after {len(SCHEDULE)} steps: ",
        eps=OPTIM.eps,
    )


@pytest.mark.parametrize("family_cls,fixture", [(LlavaVision, "llava"), (Qwen2_5_VLVision, "qwen2_5_vl")])
def test_vision_families_declare_every_parameter(tmp_path, family_cls, fixture):
    from disagg_llm_tp.parallelize import unclassified_parameters

    family = family_cls(family_cls.make_tiny(tmp_path / fixture))
    assert unclassified_parameters(family.build(), family.layer_map()) == []
