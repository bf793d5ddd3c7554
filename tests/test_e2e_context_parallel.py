"""Context parallelism for the LLM (``parallel.llm.context_parallel``) end to end through
``run_training`` against the single-process Hugging Face Qwen2.5-VL at every step (loss,
gradient norm, evaluation loss, every weight after the run), on the mixed dataset: images of
three sizes, a two-image sample whose placeholders straddle a context-parallel boundary, text-only
samples and a text-only global batch, two microbatches, weight decay on.

Layouts are combined into few runs (CI time), the tower under ``ulysses`` 2 in each: the LLM at
``ddp`` CP 2 x 2 replicas with ``shard: optimizer`` and ``recompute: full``, at ``megatron_tp``
TP 2 x CP 2, and at ``ddp`` CP 2 x 2 replicas with ``shard: parameters`` (FSDP2 + CP, a replica
without samples in a microbatch, ``train.schedule: encoders_ahead``); the first run's step-2
checkpoint is resumed at CP 1, and the TP 2 x CP 2 run's at TP 2 (layout changes, like TP
resharding).
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
from disagg.config.validate import validate  # noqa: E402
from disagg.plugins import get_registry  # noqa: E402
from disagg.testing.reference import capture_first_grads  # noqa: E402

STEPS = 3
FAMILY = "qwen2_5_vl"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_mixed_tiny(tmp_path_factory.mktemp("tiny"), FAMILY, eval_rows=4)


def _config(tiny: dict, out: Path, vision: dict, llm: dict, every: int = 0, **train: object) -> Config:
    model = {m: {"family": FAMILY, "path": tiny["models"][FAMILY]} for m in ("vision", "llm")}
    return mixed_config(model, {"vision": vision, "llm": llm}, tiny, out, STEPS, every, eval_every=1, **train)


@pytest.fixture(scope="module")
def reference(ray_local, tiny, tmp_path_factory):
    from transformers import Qwen2_5_VLForConditionalGeneration

    cfg = _config(tiny, tmp_path_factory.mktemp("ref"), {"strategy": "ddp"}, {"strategy": "ddp"})
    batches = batches_of(cfg, STEPS)
    assert [all("vision" not in s for s in b) for b in batches] == [False, True, False]
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny["models"][FAMILY], dtype=torch.float32)
    with capture_first_grads(model) as grads:  # after clipping: the tighter parameter bound
        run = train_reference(
            model,
            batches,
            qwen2_5_vl_kwargs(model.config.image_token_id),
            cfg.train,
            eval_set=eval_set_of(cfg),
        )
    return run, grads, cfg.train


def _assert_matches(run_dir: Path, reference, what: str, first: int = 1) -> None:
    """Steps ``first .. STEPS`` (a resumed run logs only those), the eval loss after each, and
    the weights after them."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    run, grads, train = reference
    assert len(run.losses) == STEPS
    assert_run_matches_reference(
        run_dir, run, train, Qwen2_5_VLForConditionalGeneration, what, grads=grads, first=first
    )


@pytest.fixture(scope="module")
def resume_dirs(tmp_path_factory) -> dict[str, Path]:
    """Where the layouts resumed below keep every step's checkpoint, for the resume tests."""
    return {name: tmp_path_factory.mktemp(name.replace("+", "-")) / "run" for name in RESUMED}


LAYOUTS = {
    # the LLM at CP 2 x 2 replicas with the optimizer state sharded over all 4 ranks (ZeRO-1:
    # CP ranks are more data-parallel ranks) and every
    # block recomputed (uneven replicas: packages/llm-tp/tests/test_context_parallel.py)
    "ulysses2+ddp_cp2x2_shard_optimizer_recompute": (
        {"strategy": "ulysses", "degree": 2},
        {"strategy": "ddp", "context_parallel": 2, "replicas": 2, "shard": "optimizer", "recompute": "full"},
    ),
    "ulysses2+tp2xcp2": (
        {"strategy": "ulysses", "degree": 2},
        {"strategy": "megatron_tp", "degree": 2, "context_parallel": 2},
    ),
    # FSDP + CP: the LLM's parameters, gradients and AdamW state FSDP2-sharded over all 4 ranks
    # (CP ranks are more data-parallel ranks); 3 microbatches of 2, 1, 1 samples over 2 replicas,
    # so replica 1 has none in the last two and forwards the placeholder sample (lockstep).
    # Under encoders_ahead (2 in flight): the tower encodes microbatch k+1 before the LLM runs k,
    # so the CP routing rows of k+1 (the replica's first rank, ``cp_rows``) are asked for, and
    # its rows sent, while k's are still to be used and its gradients to come back
    "ulysses2+ddp_cp2x2_shard_parameters": (
        {"strategy": "ulysses", "degree": 2},
        {"strategy": "ddp", "context_parallel": 2, "replicas": 2, "shard": "parameters"},
        {"microbatches": 3, "schedule": "encoders_ahead"},
    ),
}


#: layouts whose step-2 checkpoint is resumed without context parallelism -> the LLM there
RESUMED = {
    "ulysses2+ddp_cp2x2_shard_optimizer_recompute": {"strategy": "ddp"},
    "ulysses2+tp2xcp2": {"strategy": "megatron_tp", "degree": 2},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_equals_hf_model_every_step(ray_local, tiny, reference, resume_dirs, tmp_path, name):
    """The layouts of :data:`RESUMED` also keep their step-2 checkpoint for the resumes below
    (every: 1)."""
    from disagg.runtime.run import run_training

    vision, llm, *train = LAYOUTS[name]
    out = resume_dirs.get(name, tmp_path / "run")
    cfg = _config(tiny, out, vision, llm, every=1 if name in RESUMED else 0, **(train[0] if train else {}))
    run_training(validate(cfg, get_registry()), progress=False)
    _assert_matches(out, reference, name)


@pytest.mark.parametrize("name", list(RESUMED), ids=["cp2_to_cp1", "tp2xcp2_to_tp2"])
def test_cp2_checkpoint_resumes_without_context_parallel(
    ray_local, tiny, reference, resume_dirs, tmp_path, name
):
    """A CP 2 run's step-2 checkpoint (CP 2 x 2 replicas; TP 2 x CP 2), resumed with the LLM at
    CP 1 (a layout change; TP 2 stays TP 2): step 3 and the weights after it equal the HF
    model's, like the uninterrupted run."""
    from disagg.runtime.run import run_training

    ckpt = resume_dirs[name] / "checkpoints" / "step-2"
    if not ckpt.is_dir():
        pytest.skip(f"needs test_context_parallel_equals_hf_model_every_step[{name}] first")
    vision = LAYOUTS[name][0]
    cfg = _config(tiny, tmp_path / "run", vision, RESUMED[name])
    cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume_from": str(ckpt)})})
    run_training(validate(cfg, get_registry()), progress=False)
    _assert_matches(tmp_path / "run", reference, f"{name} resumed", first=3)


@pytest.mark.parametrize(
    "vision,llm,key,needle",
    [
        (
            {"strategy": "ddp", "context_parallel": 2},
            {"strategy": "ddp"},
            "parallel.vision.context_parallel",
            "only the language model",
        ),
        (
            {"strategy": "ddp"},
            {"strategy": "zero", "stage": 2, "context_parallel": 2},
            "parallel.llm.context_parallel",
            "does not support context parallelism",
        ),
        (
            {"strategy": "ddp"},
            {"strategy": "megatron_tp", "degree": 2, "context_parallel": 2, "sequence_parallel": True},
            "parallel.llm.context_parallel",
            "sequence_parallel: false",
        ),
        (
            {"strategy": "ddp"},
            {"strategy": "ddp", "context_parallel": 2, "replicas": 2, "ranks": 2},
            "parallel.llm.ranks",
            "degree × context_parallel × replicas",
        ),
    ],
)
def test_bad_context_parallel_is_a_config_error(tiny, tmp_path, vision, llm, key, needle):
    """Refused by validation, before any actor starts, naming the key and what is allowed."""
    from disagg.config.errors import ConfigError

    if llm["strategy"] == "zero":
        pytest.importorskip("disagg_zero")
    with pytest.raises(ConfigError) as err:
        _config(tiny, tmp_path, vision, llm)
    assert key in str(err.value) and needle in str(err.value), str(err.value)
