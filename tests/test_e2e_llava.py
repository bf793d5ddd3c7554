"""End to end on a tiny LLaVA dir (SigLIP tower + Llama decoder) against the
single-process ``LlavaForConditionalGeneration``, at every step, on the mixed
dataset (image sizes, a two-image sample, text-only samples and a text-only
global batch), with weight decay on.

LLaVA reads the tower's second-to-last layer, so the last SigLIP layer and the
post-layernorm never get a gradient: the reference's AdamW leaves them alone,
and so must every strategy (a zero-filled gradient would decay them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

from hf_reference import (  # noqa: E402
    assert_run_matches_reference,
    batches_of,
    pixel_values_kwargs,
    train_reference,
)
from mixed_data import make_mixed_tiny, mixed_config  # noqa: E402

from disagg.config.schema import Config  # noqa: E402
from disagg.config.validate import validate
from disagg.plugins import get_registry
from disagg.testing.reference import capture_first_grads  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_mixed_tiny(tmp_path_factory.mktemp("tiny"), "llava")


def _config(tiny: dict, out: Path, vision: dict, llm: dict) -> Config:
    model = {
        "vision": {"family": "llava", "path": tiny["models"]["llava"]},
        "llm": {"family": "llama", "path": tiny["models"]["llava"]},
    }
    return mixed_config(model, {"vision": vision, "llm": llm}, tiny, out, STEPS)


@pytest.fixture(scope="module")
def reference(ray_local, tiny, tmp_path_factory):
    from transformers import LlavaForConditionalGeneration

    cfg = _config(tiny, tmp_path_factory.mktemp("ref"), {"strategy": "ddp"}, {"strategy": "ddp"})
    model = LlavaForConditionalGeneration.from_pretrained(tiny["models"]["llava"], dtype=torch.float32)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with capture_first_grads(model) as grads:  # read-only: what the lr-unit bound is derived from
        run = train_reference(model, batches_of(cfg, STEPS), pixel_values_kwargs, cfg.train)
    unused = [k for k in initial if torch.equal(initial[k], run.state[k])]
    assert any("post_layernorm" in k for k in unused), "the tiny LLaVA should leave its last layer unused"
    assert not set(unused) & set(grads), "an unchanged parameter had a gradient"
    return run, unused, grads, cfg.train


@pytest.mark.parametrize(
    "vision,llm",
    [
        (
            {"strategy": "ulysses", "degree": 2, "replicas": 1},
            {"strategy": "megatron_tp", "degree": 2, "replicas": 1, "sequence_parallel": True},
        ),
    ],
    ids=["ulysses2+tp2sp"],
)
def test_llava_equals_hf_model_every_step(ray_local, tiny, reference, tmp_path, request, vision, llm):
    from transformers import LlavaForConditionalGeneration

    want, unused, grads, train = reference
    assert len(want.losses) == STEPS
    _run = tmp_path / "run"
    from disagg.runtime.run import run_training

    run_training(validate(_config(tiny, _run, vision, llm), get_registry()), progress=False)
    # Every parameter by the policy, none by name: SigLIP's key bias gets an exactly zero
    # gradient in exact arithmetic (softmax ignores a shift shared by all keys, no RoPE), so its
    # fp32 gradient is rounding noise; its elements are unresolved and get Adam's limit, with
    # eps = 1e-3 making that a Lipschitz bound (disagg.testing.tolerance). ``grads``: after
    # clipping, what AdamW saw (the tighter bound).
    got = assert_run_matches_reference(
        _run, want, train, LlavaForConditionalGeneration, f"llava {request.node.callspec.id}", grads=grads
    )
    for k in unused:  # never got a gradient: bit for bit untouched, weight decay or not
        assert torch.equal(got[k], want.state[k]), k
