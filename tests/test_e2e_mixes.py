"""Correctness on real data mixes, end to end through ``run_training``, against
the single-process Hugging Face model at every step.

The dataset mixes images of different sizes, a two-image sample and text-only
samples; with ``microbatches: 2`` and two encoder replicas some replicas get
no image in a microbatch, and the second global batch is text-only (the vision
group gets no work and no gradient: AdamW must leave it alone, as the
reference does). Weight decay is on, so a zero-filled gradient would move a
parameter the reference leaves untouched.
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
    eval_set_of,
    qwen2_5_vl_kwargs,
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
    # evaluated after every step: the last training batch (images of three sizes and text)
    return make_mixed_tiny(tmp_path_factory.mktemp("tiny"), "qwen2_5_vl", eval_rows=4)


def _config(tiny: dict, out: Path, vision: dict, llm: dict, **train: object) -> Config:
    model = {
        "vision": {"family": "qwen2_5_vl", "path": tiny["models"]["qwen2_5_vl"]},
        "llm": {"family": "qwen2_5_vl", "path": tiny["models"]["qwen2_5_vl"]},
    }
    return mixed_config(model, {"vision": vision, "llm": llm}, tiny, out, STEPS, eval_every=1, **train)


@pytest.fixture(scope="module")
def reference(ray_local, tiny, tmp_path_factory):
    from transformers import Qwen2_5_VLForConditionalGeneration

    cfg = _config(tiny, tmp_path_factory.mktemp("ref"), {"strategy": "ddp"}, {"strategy": "ddp"})
    batches = batches_of(cfg, STEPS)
    assert [all("vision" not in s for s in b) for b in batches] == [False, True, False]
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tiny["models"]["qwen2_5_vl"], dtype=torch.float32
    )
    kwargs = qwen2_5_vl_kwargs(model.config.image_token_id)
    with capture_first_grads(model) as grads:  # read-only: what the lr-unit bound is derived from
        run = train_reference(model, batches, kwargs, cfg.train, eval_set=eval_set_of(cfg))
    return run, grads, cfg.train


LAYOUTS = {
    "ulysses2x2+tp2": (
        {"strategy": "ulysses", "degree": 2, "replicas": 2},
        {"strategy": "megatron_tp", "degree": 2},
    ),
    # parallel.vision.shard: parameters (FSDP2, ZeRO-3 over the 4 vision ranks): a replica
    # without an image in a microbatch forwards a placeholder so that its all-gathers match
    "ulysses2x2-shard+tp2": (
        {"strategy": "ulysses", "degree": 2, "replicas": 2, "shard": "parameters"},
        {"strategy": "megatron_tp", "degree": 2},
    ),
    "zero3x2+ddp": (
        # persistence threshold 0: every parameter is partitioned and gathered for real
        {
            "strategy": "zero",
            "stage": 3,
            "replicas": 2,
            "ds_config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
        },
        {"strategy": "ddp"},
    ),
    "zero2x2+tp2": (
        {"strategy": "zero", "stage": 2, "replicas": 2},
        {"strategy": "megatron_tp", "degree": 2},
    ),
}


def _assert_matches_reference(
    run_dir: Path, reference, what: str, lr: float | None = None
) -> dict[str, torch.Tensor]:
    """``reference``: (ReferenceRun, its first gradients after clipping, train config); ``lr``:
    the largest learning rate of any parameter group (default ``train.lr``), the unit of the
    parameter bound. Every step's loss, grad norm and eval loss, and the exported weights."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    run, grads, train = reference
    assert len(run.losses) == STEPS
    return assert_run_matches_reference(
        run_dir, run, train, Qwen2_5_VLForConditionalGeneration, what, grads=grads, lr=lr
    )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_hf_model_every_step(ray_local, tiny, reference, tmp_path, name):
    from disagg.runtime.run import run_training

    vision, llm = LAYOUTS[name]
    if "zero" in (vision["strategy"], llm["strategy"]):
        pytest.importorskip("disagg_zero")
    cfg = _config(tiny, tmp_path / "run", vision, llm)
    run_training(validate(cfg, get_registry()), progress=False)
    _assert_matches_reference(tmp_path / "run", reference, name)


def test_encoders_ahead_with_four_microbatches_and_recompute_in_both_modules_equals_hf_model(
    ray_local, tiny, reference, tmp_path
):
    """The schedule changes when each microbatch runs, not the math: only the
    order of the gradient sums may differ. Both modules recompute in the same run
    (``parallel.<m>.recompute: full``: every tower block and every LLM block), with
    two microbatches in flight: recomputation changes what is
    kept, not what is computed."""
    from disagg.runtime.run import run_training

    vision, llm = LAYOUTS["ulysses2x2+tp2"]
    vision, llm = {**vision, "recompute": "full"}, {**llm, "recompute": "full"}
    cfg = _config(
        tiny, tmp_path / "run", vision, llm, microbatches=4, schedule="encoders_ahead", max_inflight=2
    )
    assert (cfg.parallel.vision.recompute, cfg.parallel.llm.recompute) == ("full", "full")
    run_training(validate(cfg, get_registry()), progress=False)
    _assert_matches_reference(tmp_path / "run", reference, "encoders_ahead x4 recompute")


FROZEN_TOWER = {
    # the common recipe: vision tower frozen, merger trained (at its own lr); the
    # LLM's input embedding frozen too, which TP splits over the vocabulary
    "vision": {"freeze": ["tower"], "param_groups": {"merger": {"lr": 3e-3}}},
    "llm": {"freeze": ["embed_tokens"]},
}


FROZEN_LAYOUTS = {
    "ulysses2+tp2": ({"strategy": "ulysses", "degree": 2}, {"strategy": "megatron_tp", "degree": 2}),
    # ZeRO-3 partitions what it trains: the frozen tower is left out of DeepSpeed's optimizer
    "zero3x2+ddp": (
        {
            "strategy": "zero",
            "stage": 3,
            "replicas": 2,
            "ds_config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
        },
        {"strategy": "ddp"},
    ),
}


@pytest.mark.parametrize("layout", list(FROZEN_LAYOUTS))
def test_frozen_tower_trains_merger_like_hf_model(ray_local, tiny, tmp_path, layout):
    """``freeze: [tower]`` equals the HF model whose tower the reference freezes
    itself (``requires_grad_(False)`` on its own submodules, AdamW groups from
    its own attributes), at every step."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from disagg.runtime.run import run_training

    vision, llm = FROZEN_LAYOUTS[layout]
    if "zero" in (vision["strategy"], llm["strategy"]):
        pytest.importorskip("disagg_zero")
    run = tmp_path / "run"
    cfg = _config(tiny, run, vision, llm, modules=FROZEN_TOWER)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tiny["models"]["qwen2_5_vl"], dtype=torch.float32
    )
    visual = model.model.visual
    visual.patch_embed.requires_grad_(False)
    visual.blocks.requires_grad_(False)
    model.model.language_model.embed_tokens.requires_grad_(False)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def groups(m: torch.nn.Module) -> list[dict]:
        merger = {id(p) for p in m.model.visual.merger.parameters()}
        rest = [p for p in m.parameters() if id(p) not in merger]
        return [{"params": rest}, {"params": list(m.model.visual.merger.parameters()), "lr": 3e-3}]

    kwargs = qwen2_5_vl_kwargs(model.config.image_token_id)
    with capture_first_grads(model) as grads:  # read-only: what the lr-unit bound is derived from
        want = train_reference(
            model, batches_of(cfg, STEPS), kwargs, cfg.train, groups, eval_set=eval_set_of(cfg)
        )
    run_training(validate(cfg, get_registry()), progress=False)
    # the merger's group lr
    got = _assert_matches_reference(run, (want, grads, cfg.train), f"frozen tower {layout}", lr=3e-3)
    tower = [k for k in initial if ".visual.patch_embed." in k or ".visual.blocks." in k]
    merger = [k for k in initial if ".visual.merger." in k]
    assert tower and merger
    for k in tower + [k for k in initial if "embed_tokens" in k]:
        assert torch.equal(got[k], initial[k]), f"{k} is frozen but moved"
    assert all(not torch.equal(got[k], initial[k]) for k in merger), "the merger should train"
    # frozen parameters hold no optimizer state; the trained ones do
    from disagg.runtime.actor.state import read_module_state

    names = set(read_module_state(run / "checkpoints" / f"step-{STEPS}", "vision")[1])
    assert names and all(n.startswith("merger.") for n in names), sorted(names)[:5]


@pytest.mark.parametrize(
    "modules,key,needle",
    [
        ({"vision": {"freeze": ["towr"]}}, "train.modules.vision.freeze.0", "(did you mean 'tower'?)"),
        (
            {"llm": {"param_groups": {"merger": {"lr": 1e-3}}}},
            "train.modules.llm.param_groups.merger",
            "names the parts: embed_tokens, layers, lm_head, norm",
        ),
        (
            {"vision": {"freeze": ["tower"], "param_groups": {"tower": {"lr": 1e-3}}}},
            "train.modules.vision.param_groups.tower",
            "is frozen",
        ),
        (
            # blocks are part of the frozen tower
            {"vision": {"freeze": ["tower"], "param_groups": {"blocks": {"lr": 1e-3}}}},
            "train.modules.vision.param_groups.blocks",
            "is frozen",
        ),
    ],
)
def test_bad_part_names_are_config_errors(tiny, tmp_path, modules, key, needle):
    """Named with the key and the family's documented parts, before any actor starts."""
    from disagg.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        _config(tiny, tmp_path, {"strategy": "ddp"}, {"strategy": "ddp"}, modules=modules)
    text = str(err.value)
    assert key in text and needle in text, text
    if "unknown part" in text and "vision" in modules:
        assert "names the parts: blocks, merger, patch_embed, tower" in text, text
