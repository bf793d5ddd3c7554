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

from encoder_steps import reference_steps, run_steps  # noqa: E402

from disagg.testing.reference import assert_close_dicts  # noqa: E402
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
        for got, want in zip(res["norm_sq"], ref["norm_sq"]):
            assert got == pytest.approx(want, rel=1e-5)
        assert set(res["with_state"]) == set(ref["with_state"]), (
            "optimizer state for a parameter never updated"
        )
    params = results[0]["params"]
    for n in unused:
        assert torch.equal(params[n], initial[n]), f"{n} moved without a gradient"
    # A key bias cannot change attention (softmax is shift invariant): its gradient is
    # rounding noise and its value stays ~1e-11 from 0, compared absolutely.
    key_bias = {n for n in params if n.endswith("self_attn.k_proj.bias")}
    rest = {n: t for n, t in params.items() if n not in key_bias}
    assert_close_dicts(rest, {n: ref["params"][n] for n in rest}, what=f"{strategy} after 3 steps: ")
    for n in key_bias:
        assert float((params[n] - ref["params"][n]).abs().max()) <= 1e-9, n


@pytest.mark.parametrize("family_cls,fixture", [(LlavaVision, "llava"), (Qwen2_5_VLVision, "qwen2_5_vl")])
def test_vision_families_declare_every_parameter(tmp_path, family_cls, fixture):
    from disagg_llm_tp.parallelize import unclassified_parameters

    family = family_cls(family_cls.make_tiny(tmp_path / fixture))
    assert unclassified_parameters(family.build(), family.layer_map()) == []
