"""Checkpoints on the tiny Qwen2.5-VL, end to end through ``run_training``.

Save at step 3, resume to step 6: the resumed run's per-step losses equal the
uninterrupted 6-step run's bit for bit (same layout: the checkpoint, sharded by
default (each rank its own pieces), restores every parameter, AdamW moment, step
count, scheduler position, random stream and the data position exactly; CPU fp32 kernels are
deterministic). Under a different layout (resharding from the ranks' pieces: ``megatron_tp`` 2 -> 4,
``ulysses`` -> ``zero`` 2 reading every tensor whole) the losses equal the
unsharded run's within 1e-5: only the summation order of the collectives
changes, and the exports of the LLM ``megatron_tp`` 4 and ``ddp`` resumes hold
the same weights. A ``zero`` 3 checkpoint exports to a Hugging Face dir whose model
reproduces the loss the run logged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from disagg.plugins import get_registry

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_zero")

from e2e_run import e2e_config  # noqa: E402
from hf_reference import batches_of, qwen2_5_vl_kwargs, train_reference  # noqa: E402

from disagg.config.validate import validate
from disagg.testing.tolerance import assert_exact, assert_params_close, assert_scalar_close  # noqa: E402

FAMILY = "qwen2_5_vl"
STEPS = 6
ULYSSES2 = {"strategy": "ulysses", "degree": 2}
TP2 = {"strategy": "megatron_tp", "degree": 2}
# persistence threshold 0: every parameter is partitioned for real
ZERO3 = {
    "strategy": "zero",
    "stage": 3,
    "replicas": 2,
    "ds_config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from disagg.cli.make_tiny import make_tiny

    out = tmp_path_factory.mktemp("tiny")
    return make_tiny(out, [FAMILY], train_per_class=1, eval_per_class=1, image_size=56)


def _config(tiny: dict, out: Path, vision: dict, llm: dict, resume: Path | None = None):
    cfg = e2e_config(
        tiny,
        out,
        {"vision": (FAMILY, FAMILY), "llm": (FAMILY, FAMILY)},
        {"vision": vision, "llm": llm},
        STEPS,
    )
    return cfg.model_copy(
        update={
            "checkpoint": cfg.checkpoint.model_copy(
                update={"every": 3, "resume_from": str(resume) if resume else None}
            )
        }
    )


def _run(cfg) -> dict[int, float]:
    from disagg.runtime.run import run_training

    run_training(validate(cfg, get_registry()), progress=False)
    rows = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "step" in r}


@pytest.fixture(scope="module")
def dhp(ray_local, tiny, tmp_path_factory):
    """The uninterrupted 6-step run: vision ulysses 2 + LLM megatron_tp 2."""
    cfg = _config(tiny, tmp_path_factory.mktemp("dhp"), ULYSSES2, TP2)
    return cfg, _run(cfg)


@pytest.fixture(scope="module")
def zero3(ray_local, tiny, tmp_path_factory):
    cfg = _config(tiny, tmp_path_factory.mktemp("zero3"), ZERO3, ZERO3)
    return cfg, _run(cfg)


def _step3(cfg) -> Path:
    return Path(cfg.output_dir) / "checkpoints" / "step-3"


@pytest.mark.parametrize("which", ["dhp", "zero3"])
def test_resume_equals_uninterrupted_bit_for_bit(which, request, tiny, tmp_path):
    cfg, losses = request.getfixturevalue(which)
    assert sorted(losses) == list(range(1, STEPS + 1))
    parallel = cfg.parallel
    resumed = _run(
        _config(
            tiny, tmp_path / "resumed", parallel.vision.model_dump(), parallel.llm.model_dump(), _step3(cfg)
        )
    )
    assert sorted(resumed) == [4, 5, 6]
    assert [resumed[s] for s in (4, 5, 6)] == [losses[s] for s in (4, 5, 6)]  # exact, not approx


RESHARDS = {
    "llm tp2 -> tp4": (ULYSSES2, {"strategy": "megatron_tp", "degree": 4}),
    "llm tp2 -> ddp, vision ulysses2 -> zero2": (
        {"strategy": "zero", "stage": 2, "replicas": 2},
        {"strategy": "ddp"},
    ),
}


@pytest.fixture(scope="module")
def resharded(dhp, tiny, tmp_path_factory):
    """``name -> (config, losses)``: the DHP step-3 checkpoint resumed under
    ``RESHARDS[name]`` to step 6, each run once for the module (the export
    test reuses the runs' final checkpoints)."""
    runs: dict[str, tuple] = {}

    def run(name: str) -> tuple:
        if name not in runs:
            vision, llm = RESHARDS[name]
            cfg = _config(tiny, tmp_path_factory.mktemp("resharded"), vision, llm, _step3(dhp[0]))
            runs[name] = (cfg, _run(cfg))
        return runs[name]

    return run


@pytest.mark.parametrize("name", list(RESHARDS))
def test_resharded_resume_continues_the_losses(name, dhp, resharded):
    _, losses = dhp
    _, resumed = resharded(name)
    assert sorted(resumed) == [4, 5, 6]
    for s in (4, 5, 6):
        assert_scalar_close(resumed[s], losses[s], f"{name} step {s} loss")


def test_tp4_export_equals_ddp_export(resharded, tmp_path):
    """``disagg export`` of the step-6 checkpoints saved under LLM
    ``megatron_tp`` 4 and under ``ddp`` (same step-3 start, same data) gives
    HF dirs with the same weights, each loading with ``from_pretrained``."""
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    from disagg.cli.main import main

    exported = {}
    for name in RESHARDS:
        cfg, _ = resharded(name)
        dest = tmp_path / cfg.parallel.llm.strategy
        assert main(["export", str(Path(cfg.output_dir) / "checkpoints" / f"step-{STEPS}"), str(dest)]) == 0
        _, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            str(dest), dtype=torch.float32, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        exported[name] = load_file(str(dest / "model.safetensors"))
    tp4, ddp = (exported[name] for name in RESHARDS)
    # three steps after the reshard under different reduction orders: two runs of the code, no
    # reference gradients, so the bound is the policy's eps-Lipschitz one (Adam's eps=1e-3, every
    # gradient element Adam sees at most clip_grad_norm): disagg.testing.tolerance
    train = cfg.train
    assert_params_close(
        tp4,
        ddp,
        lr=train.lr,
        steps=STEPS - 3,
        grads=None,
        what="megatron_tp 4 export vs ddp export: ",
        eps=train.eps,
        betas=tuple(train.betas),
        grad_bound=train.clip_grad_norm,
    )


def test_zero3_export_reproduces_the_trained_loss(zero3, tmp_path):
    """Step 4's logged loss is that of the step-3 weights on the 4th batch."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from disagg.plugins import get_registry
    from disagg.runtime.export import export_checkpoint

    cfg, losses = zero3
    (dest,) = export_checkpoint(_step3(cfg), tmp_path / "export", get_registry())
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(dest), dtype=torch.float32)
    batch = batches_of(cfg, 4)[3]
    ref = train_reference(model, [batch], qwen2_5_vl_kwargs(model.config.image_token_id), cfg.train)
    assert_scalar_close(losses[4], ref.losses[0], "step 4 loss of the exported step-3 weights")


def test_tp2_sharded_export_loads_and_reproduces_the_trained_loss(dhp, tmp_path):
    """``disagg export --max-shard-size 200KB`` of the LLM ``megatron_tp`` 2 run's
    step-3 checkpoint: several HF shards and their index, which ``from_pretrained``
    loads with no missing, unexpected or mismatched key, and whose model gives
    the loss the run logged at step 4 (the step-3 weights' forward on the 4th
    batch); the bf16 export holds the same tensors cast to bf16."""
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    from disagg.cli.main import main

    cfg, losses = dhp
    out = tmp_path / "sharded"
    assert main(["export", str(_step3(cfg)), str(out), "--max-shard-size", "200KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n >= 3 and shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)], shards
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    model, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(out), dtype=torch.float32, output_loading_info=True
    )
    assert {k: list(v) for k, v in info.items() if v} == {}, info  # missing/unexpected/mismatched/errors
    batch = batches_of(cfg, 4)[3]
    ref = train_reference(model, [batch], qwen2_5_vl_kwargs(model.config.image_token_id), cfg.train)
    assert_scalar_close(losses[4], ref.losses[0], "step 4 loss of the sharded export of the step-3 weights")

    bf16 = tmp_path / "bf16"
    assert main(["export", str(_step3(cfg)), str(bf16), "--dtype", "bf16"]) == 0
    fp32 = {}
    for s in shards:
        fp32.update(load_file(str(out / s)))
    assert_exact(
        load_file(str(bf16 / "model.safetensors")), {k: v.to(torch.bfloat16) for k, v in fp32.items()}
    )
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
