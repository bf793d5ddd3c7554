"""Qwen3.5 (issue 40) end to end against the single-process
``Qwen3_5ForConditionalGeneration``, at every step: the tower (``qwen3_5`` vision
family) under ``ulysses`` 2, the hybrid decoder (gated-delta-net and gated
full-attention layers) under ``ddp`` over 2 replicas with ``shard: optimizer``,
under ``zero`` stage 3 over 2 replicas and under ``megatron_tp`` 2 with sequence
parallelism over 2 replicas (the gated-delta-net layers split by heads,
``disagg_llm_tp.gdn``), on the mixed dataset (image sizes, a
two-image sample, text-only samples and a text-only global batch; two
microbatches whose samples split unevenly between the decoder's replicas: one
replica's sample has images, the other's none; weight decay on). Loss and
gradient norm of every step, and every parameter after the last step read back
from ``disagg export`` through ``from_pretrained``. ``recompute: full`` on the decoder in
one layout and on the tower in the other.

Context parallelism, and a ``megatron_tp`` degree that does not divide the
gated-delta-net heads, are refused for the decoder before any actor starts, each
with its reason (``disagg_llm_tp.families.qwen3_5``, ``disagg_llm_tp.gdn``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_zero")

from hf_reference import assert_run_matches_reference, batches_of, qwen2_5_vl_kwargs, train_reference  # noqa: E402
from mixed_data import make_mixed_tiny, mixed_config  # noqa: E402

from disagg.config.validate import validate  # noqa: E402
from disagg.plugins import get_registry  # noqa: E402

STEPS = 3
TOWER = {"strategy": "ulysses", "degree": 2}
#: (tower, decoder) per layout; recompute: full in one module of each (HF's checkpointing layers:
#: the decoder's linear- and full-attention layers, the tower's blocks, replayed in backward)
LAYOUTS = {
    # core allows an LLM under ddp to shard its optimizer state only (parameters: zero or megatron_tp)
    "ulysses2+ddp2-shard": (
        TOWER,
        {"strategy": "ddp", "replicas": 2, "shard": "optimizer", "recompute": "full"},
    ),
    "ulysses2+zero3x2": (
        {**TOWER, "recompute": "full"},
        # persistence threshold 0: every parameter is partitioned and gathered for real
        {
            "strategy": "zero",
            "stage": 3,
            "replicas": 2,
            "ds_config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
        },
    ),
    # the decoder built empty and loaded by slices; every layer kind split by heads
    "ulysses2+megatron_tp2-sp-x2": (
        TOWER,
        {"strategy": "megatron_tp", "degree": 2, "replicas": 2, "sequence_parallel": True},
    ),
}


def _config(tiny: dict, out: Path, vision: dict, llm: dict):  # noqa: ANN202
    path = tiny["models"]["qwen3_5"]
    model = {m: {"family": "qwen3_5", "path": path} for m in ("vision", "llm")}
    return mixed_config(model, {"vision": vision, "llm": llm}, tiny, out, STEPS)


@pytest.fixture(scope="module")
def qwen3_5(ray_local, tmp_path_factory):
    """The tiny dir and its HF reference run."""
    from transformers import Qwen3_5ForConditionalGeneration

    tiny = make_mixed_tiny(tmp_path_factory.mktemp("tiny"), "qwen3_5")
    ddp = {"strategy": "ddp"}
    cfg = _config(tiny, tmp_path_factory.mktemp("ref"), ddp, ddp)
    batches = batches_of(cfg, STEPS)
    assert [all("vision" not in s for s in b) for b in batches] == [False, True, False]
    assert any(s["vision"]["image_grid_thw"].shape[0] == 2 for s in batches[0] if "vision" in s)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(tiny["models"]["qwen3_5"], dtype=torch.float32)
    kinds = set(model.config.text_config.layer_types)
    assert kinds == {"linear_attention", "full_attention"}, kinds
    return tiny, train_reference(model, batches, qwen2_5_vl_kwargs(model.config.image_token_id), cfg.train)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qwen3_5_equals_hf_model_every_step(ray_local, qwen3_5, tmp_path, layout):
    from transformers import Qwen3_5ForConditionalGeneration

    from disagg.runtime.run import run_training

    tiny, want = qwen3_5
    run = tmp_path / "run"
    cfg = _config(tiny, run, *LAYOUTS[layout])
    run_training(validate(cfg, get_registry()), progress=False)
    assert len(want.losses) == STEPS
    assert_run_matches_reference(run, want, cfg.train, Qwen3_5ForConditionalGeneration, f"qwen3_5 {layout}")


@pytest.mark.parametrize(
    ("llm", "words"),
    [
        # the tiny decoder's linear layers: 2 key heads (4 value heads)
        ({"strategy": "megatron_tp", "degree": 4}, ("gated-delta-net", "2 key heads", "degree 4", "1, 2")),
        ({"strategy": "ddp", "context_parallel": 2}, ("context_parallel", "'qwen3_5'", "use 1")),
    ],
)
def test_what_cannot_be_exact_is_refused_with_the_reason(qwen3_5, tmp_path, llm, words):
    from disagg.config.validate import ConfigError

    tiny, _ = qwen3_5
    with pytest.raises(ConfigError) as err:
        _config(tiny, tmp_path / "run", TOWER, llm)  # validates
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_a_qwen3_5_dir_under_another_family_names_qwen3_5(qwen3_5):
    from disagg_llm_tp.families.qwen3_vl import Qwen3VLLanguageFamily
    from disagg_vision_sp.families.qwen3_vl import Qwen3VLVision

    path = qwen3_5[0]["models"]["qwen3_5"]
    for family in (Qwen3VLVision(path), Qwen3VLLanguageFamily(path)):
        (problem,) = family.check("ddp", 1, 1)
        assert "'qwen3_5' model" in problem and "use family 'qwen3_5'" in problem, problem
