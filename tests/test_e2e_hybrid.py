"""End to end on a tiny Qwen2.5-VL through `run_training`: every mix of
strategies has the loss trajectory and final weights of the all-`ddp` run, and
all-`ddp` has the loss of the single-process Hugging Face model.

This is the disaggregated hybrid configuration of the published result
(vision Ulysses SP + LLM Megatron TP), plus the mixed ZeRO backends.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

from e2e_run import DDP, e2e_config, train  # noqa: E402

from disagg.plugins import get_registry  # noqa: E402
from disagg.testing.reference import assert_close_dicts  # noqa: E402

FAMILY = "qwen2_5_vl"
STEPS = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from disagg.cli.make_tiny import make_tiny

    out = tmp_path_factory.mktemp("tiny")
    return make_tiny(out, [FAMILY], train_per_class=1, eval_per_class=1, image_size=56)


def _config(tiny, out: Path, vision: dict, llm: dict):
    families = {"vision": (FAMILY, FAMILY), "llm": (FAMILY, FAMILY)}
    return e2e_config(tiny, out, families, {"vision": vision, "llm": llm}, STEPS)


def _train(tiny, out: Path, vision: dict, llm: dict):
    return train(_config(tiny, out, vision, llm))


@pytest.fixture(scope="module")
def all_ddp(ray_local, tiny, tmp_path_factory):
    return _train(tiny, tmp_path_factory.mktemp("ddp"), DDP, DDP)


def _assert_equivalent(got, want):
    assert got[0] == pytest.approx(want[0], rel=1e-5), (got[0], want[0])
    for m in ("vision", "llm"):
        assert_close_dicts(got[1][m], want[1][m], what=f"{m} after {STEPS} steps: ")


# The paper's DHP (ulysses vision + TP LLM) and zero2 vision + TP LLM are
# checked against the single-process HF model on mixed data in test_e2e_mixes.
HYBRIDS = {
    "vision_ulysses2+llm_ddp": ({"strategy": "ulysses", "degree": 2}, DDP),
    "uniform_tp2": ({"strategy": "megatron_tp", "degree": 2}, {"strategy": "megatron_tp", "degree": 2}),
    "vision_ulysses2+llm_tp2_sequence_parallel": (
        {"strategy": "ulysses", "degree": 2},
        {"strategy": "megatron_tp", "degree": 2, "sequence_parallel": True},
    ),
    "uniform_tp2_sequence_parallel": (
        {"strategy": "megatron_tp", "degree": 2, "sequence_parallel": True},
        {"strategy": "megatron_tp", "degree": 2, "sequence_parallel": True},
    ),
    "vision_ulysses2+llm_zero3": (
        {"strategy": "ulysses", "degree": 2},
        {"strategy": "zero", "stage": 3, "replicas": 2},
    ),
    "uniform_zero3": (
        {"strategy": "zero", "stage": 3, "replicas": 2},
        {"strategy": "zero", "stage": 3, "replicas": 2},
    ),
}


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_mix_equals_all_ddp(ray_local, tiny, all_ddp, tmp_path, name):
    vision, llm = HYBRIDS[name]
    if "zero" in (vision["strategy"], llm["strategy"]):
        pytest.importorskip("disagg_zero")
    got = _train(tiny, tmp_path / "run", {"replicas": 1, **vision}, {"replicas": 1, **llm})
    _assert_equivalent(got, all_ddp)
    assert got[0][-1] < got[0][0], "the loss should fall over the run"


def test_all_ddp_first_step_equals_hugging_face_model(ray_local, tiny, all_ddp, tmp_path):
    """The first global batch through the single-process HF VLM gives the first logged loss."""
    import ray
    from transformers import Qwen2_5_VLForConditionalGeneration

    from disagg.data import build_data_source
    from disagg.runtime.plan import families_for

    cfg = _config(tiny, tmp_path / "x", DDP, DDP)
    source = build_data_source(cfg, families_for(cfg, get_registry()))
    batch = next(source.batches(0))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tiny["models"][FAMILY], torch_dtype=torch.float32
    )
    total, count = 0.0, 0
    for s in batch:
        llm = ray.get(s.inputs["llm"])
        kw = {}
        if "vision" in s.inputs:
            v = ray.get(s.inputs["vision"])
            # mm_token_type_ids is what the HF processor returns; mRoPE needs it
            kw = {
                "pixel_values": v["pixel_values"],
                "image_grid_thw": v["image_grid_thw"],
                "mm_token_type_ids": (llm["input_ids"][None] == model.config.image_token_id).int(),
            }
        out = model(input_ids=llm["input_ids"][None], labels=llm["labels"][None], **kw)
        n = int((llm["labels"][1:] != -100).sum())
        total += float(out.loss.detach()) * n
        count += n
    assert all_ddp[0][0] == pytest.approx(total / count, rel=1e-5)


@pytest.mark.parametrize(
    "vision,needle",
    [
        ({"strategy": "megatron_tp", "degree": 1, "sequence_parallel": True}, "degree >= 2"),
        ({"strategy": "megatron_tp", "degree": 2, "sequence_parallel": "yes please"}, "sequence_parallel"),
    ],
)
def test_bad_sequence_parallel_is_a_config_error(tiny, tmp_path, vision, needle):
    """Caught by validation, before any actor starts, with the config key."""
    from disagg.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        _config(tiny, tmp_path, vision, DDP)
    assert "parallel.vision" in str(err.value) and needle in str(err.value)
