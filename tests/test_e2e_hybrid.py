"""End to end on a tiny Qwen2.5-VL through `run_training`: every mix of
strategies equals the single-process Hugging Face model
(``Qwen2_5_VLForConditionalGeneration``, one AdamW, ``tests/hf_reference.py``)
at every step: the logged loss and gradient norm of each step, and every
weight after each step (each step's checkpoint, exported and loaded back with
``from_pretrained``), through the tolerance policy (parameters in units of the
learning rate per element, ``disagg.testing.tolerance``).

This is the disaggregated hybrid configuration of the published result
(vision Ulysses SP + LLM Megatron TP), plus the mixed ZeRO backends.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from disagg.config.validate import validate
from disagg.plugins import get_registry

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

from e2e_run import DDP, e2e_config  # noqa: E402
from hf_reference import (  # noqa: E402
    ReferenceRun,
    assert_run_matches,
    batches_of,
    exported_state,
    qwen2_5_vl_kwargs,
    train_reference,
)

FAMILY = "qwen2_5_vl"
STEPS = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from disagg.cli.make_tiny import make_tiny

    out = tmp_path_factory.mktemp("tiny")
    return make_tiny(out, [FAMILY], train_per_class=1, eval_per_class=1, image_size=56)


def _config(tiny, out: Path, vision: dict, llm: dict):
    families = {"vision": (FAMILY, FAMILY), "llm": (FAMILY, FAMILY)}
    return e2e_config(tiny, out, families, {"vision": vision, "llm": llm}, STEPS, checkpoint_every=1)


@pytest.fixture(scope="module")
def reference(ray_local, tiny, tmp_path_factory) -> ReferenceRun:
    """The HF model trained on the run's global batches, its state kept after every step."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    cfg = _config(tiny, tmp_path_factory.mktemp("ref"), DDP, DDP)
    batches = batches_of(cfg, STEPS)
    assert all(any("vision" in s for s in b) for b in batches), "every step should carry images"
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny["models"][FAMILY], dtype=torch.float32)
    return train_reference(model, batches, qwen2_5_vl_kwargs(model.config.image_token_id), cfg.train)


def _assert_every_step(run: Path, reference: ReferenceRun, train) -> list[float]:  # noqa: ANN001
    """The run's loss and grad norm of every step, and its weights after every step (each step's
    checkpoint, exported and loaded back), against the reference's; returns its losses."""
    from transformers import Qwen2_5_VLForConditionalGeneration as VLM

    return assert_run_matches(
        run, reference, lambda step: exported_state(run, step, run.parent / f"export-{step}", VLM), train
    )


# test_e2e_mixes checks the paper's DHP (ulysses vision + TP LLM) and zero2/zero3
# layouts on mixed data (text-only steps, uneven replicas); these are the other mixes.
HYBRIDS = {
    "all_ddp": (DDP, DDP),
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
def test_mix_equals_hf_model_every_step(ray_local, tiny, reference, tmp_path, name):
    from disagg.runtime.run import run_training

    vision, llm = HYBRIDS[name]
    if "zero" in (vision["strategy"], llm["strategy"]):
        pytest.importorskip("disagg_zero")
    cfg = _config(tiny, tmp_path / "run", {"replicas": 1, **vision}, {"replicas": 1, **llm})
    run_training(validate(cfg, get_registry()), progress=False)
    losses = _assert_every_step(tmp_path / "run", reference, cfg.train)
    assert losses[-1] < losses[0], "the loss should fall over the run"


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


def test_overlapped_gradient_reduction_equals_hf_model_every_step(ray_local, tiny, reference, tmp_path):
    """``overlap_grad_reduce``: each bucket summed while the step's last backward runs (ulysses
    vision, whose backward runs its own all-to-alls meanwhile, and a 2-replica ddp LLM), 2
    microbatches: the same run as the HF model at every step, and buckets were sent early."""
    import json

    from disagg.config.validate import validate
    from disagg.plugins import get_registry
    from disagg.runtime.run import run_training

    vision = {"strategy": "ulysses", "degree": 2, "replicas": 1, "overlap_grad_reduce": True}
    llm = {"strategy": "ddp", "replicas": 2, "overlap_grad_reduce": True}
    cfg = _config(tiny, tmp_path / "run", vision, llm)
    cfg.train.microbatches = 2
    resolved = validate(cfg, get_registry())
    run_training(resolved, progress=False)
    _assert_every_step(tmp_path / "run", reference, cfg.train)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    overlapped = [x["overlapped_calls_per_rank"] for x in lines if "overlapped_calls_per_rank" in x]
    assert len(overlapped) == STEPS
    # every LLM replica's last microbatch has text: its bucket goes out inside that backward
    assert all(o["llm"] > 0 for o in overlapped), overlapped
    assert any(o["vision"] > 0 for o in overlapped), overlapped
    # per-module accounting (docs/metrics.md): each group's model FLOPs, MFU against the CPU
    # preset's peak per rank (train.log says which), active tokens per rank, idle fraction
    from disagg.plan.cluster import PRESETS

    peak = PRESETS["cpu"].peak_flops
    assert "mfu: peak per device cpu: 20 GFLOP/s per rank" in (tmp_path / "run" / "train.log").read_text()
    for x in lines:
        assert set(x["flops"]) == set(x["mfu"]) == set(x["idle_fraction"]) == {"vision", "llm"}, x
        for m, ranks in (("vision", 2), ("llm", 2)):
            assert x["flops"][m] > 0 and 0 <= x["idle_fraction"][m] <= 1
            assert x["mfu"][m] == pytest.approx(x["flops"][m] / (x["step_time_s"] * ranks * peak))
            per_device = x["module_tokens"][m] / (x["step_time_s"] * ranks)
            assert x["active_tokens_per_s_per_device"][m] == pytest.approx(per_device)


def test_overlap_is_refused_where_the_strategy_reduces_its_own_way(tiny, tmp_path):
    """megatron_tp and zero reduce gradients themselves: the key is theirs to refuse, by name."""
    from disagg.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        _config(tiny, tmp_path, DDP, {"strategy": "megatron_tp", "degree": 2, "overlap_grad_reduce": True})
    assert "parallel.llm" in str(err.value) and "overlap_grad_reduce" in str(err.value)
