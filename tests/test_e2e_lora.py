"""LoRA per module (``train.modules.<m>.lora``), end to end through ``run_training``, against
the single-process Hugging Face model with PEFT's adapters, at every step.

The reference is ``Qwen2_5_VLForConditionalGeneration`` with PEFT's LoRA injected into its
vision tower (targets ``attn.qkv`` — the fused projection — and ``attn.proj``) and into its
language model (``q_proj``, ``v_proj``), each under the same ``LoraConfig`` and after
``torch.manual_seed(lora_seed(train.seed, module))``, the seed core draws the adapters under;
the merger trains in full (PEFT's ``modules_to_save`` trains a copy of the module; core trains
the module itself: the same numbers). Data: ``tests/mixed_data.py`` (images of three sizes, a
two-image sample, a text-only step, uneven replicas, 2 microbatches, weight decay on).

Two layouts cover ulysses (2) and megatron_tp (2: column-parallel adapters), both recomputing,
under the ``encoders_ahead`` schedule (2 microbatches in flight), and ZeRO-1 and ZeRO-3 (2 replicas
each); ZeRO-2 and ddp through a resume: each run equals the reference within 1e-6 relative in
loss and grad norm at every step, and in adapter and merger parameters after every step (the
tolerance policy, in lr units); every checkpoint holds exactly the trained tensors (no base
weight) with optimizer state for exactly them. The ZeRO-3 run's step-2 checkpoint resumes
under ZeRO-2 x 2 on the tower and ddp on the LLM (another layout, both recomputing) and its
step 3 equals the reference's. (ulysses with LoRA unsharded without recompute, its shard
modes, 2 x 2 replicas and adapter dropout: packages/vision-sp/tests/test_sharded_state.py;
megatron_tp with sequence parallelism, with and without recompute full:
packages/llm-tp/tests/test_lora_tp.py.) The TP run's export loads as PEFT adapter dirs over
the exported base (``PeftModel.from_pretrained``) and, with ``--merge``, as plain HF weights,
both with the trained model's logits (1e-5).
Base weights bit-identical after training are asserted where the strategy's whole state is
read back (``packages/llm-tp/tests/test_lora_tp.py``); here the checkpoint's contents show
the base never trained.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from disagg.plugins import get_registry

pytest.importorskip("peft")
pytest.importorskip("disagg_vision_sp")

from hf_reference import batches_of, qwen2_5_vl_kwargs, run_metrics, train_reference  # noqa: E402
from mixed_data import make_mixed_tiny, mixed_config  # noqa: E402

from disagg.config.validate import validate
from disagg.testing.tolerance import FP32, Precision, assert_params_close  # noqa: E402
from disagg.testing.tolerance import assert_scalar_close as scalar_close  # noqa: E402

STEPS = 3
#: the issue's bound: 1e-6 relative, fp32, through the policy
TIGHT = Precision("fp32-1e-6", rtol=1e-6, param_unit=FP32.param_unit)
VISION_LORA = {"r": 4, "alpha": 8, "targets": ["attn.qkv", "attn.proj"], "modules_to_save": ["merger"]}
LLM_LORA = {"r": 4, "alpha": 16, "targets": ["q_proj", "v_proj"]}
#: the prefix of each module's parameters in the whole HF model
PREFIX = {"vision": "model.visual.", "llm": ""}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_mixed_tiny(tmp_path_factory.mktemp("tiny"), "qwen2_5_vl")


def _config(tiny: dict, out: Path, vision: dict, llm: dict, modules: dict | None = None, **train):
    path = tiny["models"]["qwen2_5_vl"]
    model = {"vision": {"family": "qwen2_5_vl", "path": path}, "llm": {"family": "qwen2_5_vl", "path": path}}
    mods = {"vision": {"lora": VISION_LORA}, "llm": {"lora": LLM_LORA}} if modules is None else modules
    return mixed_config(
        model, {"vision": vision, "llm": llm}, tiny, out, STEPS, checkpoint_every=1, modules=mods, **train
    )


def _peft(spec: dict):  # PEFT's own config, built here from the test's values
    from peft import LoraConfig

    return LoraConfig(
        r=spec["r"], lora_alpha=spec["alpha"], lora_dropout=0.0, target_modules=spec["targets"], bias="none"
    )


@pytest.fixture(scope="module")
def reference(ray_local, tiny, tmp_path_factory):
    from peft import inject_adapter_in_model
    from transformers import Qwen2_5_VLForConditionalGeneration

    from disagg.interfaces.lora import lora_seed
    from disagg.testing.reference import capture_first_grads

    cfg = _config(tiny, tmp_path_factory.mktemp("ref"), {"strategy": "ddp"}, {"strategy": "ddp"})
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tiny["models"]["qwen2_5_vl"], dtype=torch.float32
    )
    torch.manual_seed(lora_seed(cfg.train.seed, "vision"))
    inject_adapter_in_model(_peft(VISION_LORA), model.model.visual)
    torch.manual_seed(lora_seed(cfg.train.seed, "llm"))
    inject_adapter_in_model(_peft(LLM_LORA), model.model.language_model)
    # PEFT freezes every base weight of the modules it injected into; the merger trains in full
    model.lm_head.requires_grad_(False)
    model.model.visual.merger.requires_grad_(True)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n or ".merger." in n for n in trained), sorted(trained)[:5]
    kwargs = qwen2_5_vl_kwargs(model.config.image_token_id)
    batches = batches_of(cfg, STEPS)
    with capture_first_grads(model) as grads:
        run = train_reference(model, batches, kwargs, cfg.train)
    model.eval()
    sample = batches[0][0]  # a large image and its answer
    assert "vision" in sample
    with torch.no_grad():
        logits = model(**kwargs(sample)).logits
    return run, grads, cfg.train, initial, trained, (kwargs(sample), logits)


def _ckpt(run_dir: Path, step: int, what: str = "full") -> dict:
    """A checkpoint's tensors (``full``: parameters; ``optim``: their optimizer states), named
    as the whole HF model names them, from either form (sharded, the default, or zero's full)."""
    from disagg.runtime.actor.state import read_module_state

    out = {}
    for m, prefix in PREFIX.items():
        params, optim = read_module_state(run_dir / "checkpoints" / f"step-{step}", m)
        out.update({prefix + k: v for k, v in (params if what == "full" else optim).items()})
    return out


def _assert_steps(run_dir: Path, reference, steps: range, what: str) -> None:
    """Loss and grad norm of ``steps`` (1-based) from metrics.jsonl, and the checkpoint after
    each: it holds exactly the trained tensors (adapters, the merger), equal to the reference's
    in lr units; the optimizer state covers exactly them too."""
    run, grads, train, _, trained, _ = reference
    losses, norms = run_metrics(run_dir)
    assert len(losses) == len(norms) == len(steps), (len(losses), steps)
    for i, step in enumerate(steps):
        scalar_close(losses[i], run.losses[step - 1], f"{what} step {step} loss", TIGHT)
        scalar_close(norms[i], run.grad_norms[step - 1], f"{what} step {step} grad norm", TIGHT)
        got, want = _ckpt(run_dir, step), run.states[step - 1]
        assert set(got) == trained, sorted(set(got) ^ trained)[:6]  # no base weight is saved
        assert_params_close(
            got,
            {k: want[k] for k in trained},
            lr=train.lr,
            steps=step,
            grads=grads,
            what=f"{what} after step {step}: ",
            precision=TIGHT,
            eps=train.eps,
            betas=tuple(train.betas),
        )
        optim = set(_ckpt(run_dir, step, "optim"))
        assert optim == trained, sorted(optim ^ trained)[:6]


LAYOUTS = {
    # ulysses over the tower's patches; megatron_tp's column-parallel adapters on q/v; both
    # recompute (the adapters replayed with their blocks); the encoders_ahead schedule (the
    # tower encodes both microbatches before the LLM runs the first, then backward 0 runs
    # while microbatch 1's activations are held)
    "ulysses2+tp2": (
        {"strategy": "ulysses", "degree": 2, "recompute": "full"},
        {"strategy": "megatron_tp", "degree": 2, "recompute": "full"},
        {"schedule": "encoders_ahead", "max_inflight": 2},
    ),
    # ZeRO-1 on the tower, ZeRO-3 partitioning the LLM's adapters over 2 replicas
    "zero1x2+zero3x2": (
        {"strategy": "zero", "stage": 1, "replicas": 2},
        {
            "strategy": "zero",
            "stage": 3,
            "replicas": 2,
            "ds_config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
        },
        {},
    ),
}
#: the layout the ZeRO run's step-2 checkpoint resumes under: ZeRO-2 on the tower (its
#: gradients partitioned over 2 replicas), ddp on the LLM (which reads only its own pieces),
#: both recomputing
RESUMED = (
    {"strategy": "zero", "stage": 2, "replicas": 2, "recompute": "full"},
    {"strategy": "ddp", "recompute": "full"},
)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_equals_peft_model_every_step(ray_local, tiny, reference, tmp_path, name):
    from disagg.runtime.run import run_training

    if "zero" in name:
        pytest.importorskip("disagg_zero")
    vision, llm, train = LAYOUTS[name]
    cfg = _config(tiny, tmp_path / "run", vision, llm, **train)
    run_training(validate(cfg, get_registry()), progress=False)
    _assert_steps(tmp_path / "run", reference, range(1, STEPS + 1), name)
    if name == "ulysses2+tp2":
        _assert_exports(tmp_path / "run", reference, tmp_path)
    else:
        # resume the last step from this run's checkpoint under another layout (the adapters
        # reshard like full weights; the base comes from the model dir)
        resumed = _config(tiny, tmp_path / "resumed", *RESUMED)
        resumed.checkpoint.resume_from = str(tmp_path / "run" / "checkpoints" / f"step-{STEPS - 1}")
        run_training(validate(resumed, get_registry()), progress=False)
        _assert_steps(tmp_path / "resumed", reference, range(STEPS, STEPS + 1), "resumed under zero2x2+ddp")


def _assert_exports(run_dir: Path, reference, tmp_path: Path) -> None:
    """``disagg export`` of the TP 2 run: the PEFT adapter dirs load on the exported base with
    ``PeftModel.from_pretrained`` and give the trained model's logits; ``--merge`` writes
    weights ``from_pretrained`` loads with the same logits (1e-5, the policy's fp32 bound)."""
    from peft import PeftModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    from disagg.plugins import get_registry
    from disagg.runtime.export import export_checkpoint, read_manifest
    from disagg.testing.tolerance import assert_tensor_close

    *_, (kwargs, want) = reference
    ckpt = run_dir / "checkpoints" / f"step-{STEPS}"
    (base,) = export_checkpoint(ckpt, tmp_path / "peft", get_registry())
    manifest = read_manifest(tmp_path / "peft")
    assert {m: e["lora"] for m, e in manifest["modules"].items()} == {
        "vision": "adapters/vision",
        "llm": "adapters/llm",
    }
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(base), dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(tmp_path / "peft" / "adapters" / "llm"), adapter_name="llm")
    model.load_adapter(str(tmp_path / "peft" / "adapters" / "vision"), adapter_name="vision")
    model.base_model.set_adapter(["llm", "vision"])
    model.eval()
    with torch.no_grad():
        assert_tensor_close(model(**kwargs).logits, want, "logits of the PEFT adapter dirs")
    (merged,) = export_checkpoint(ckpt, tmp_path / "merged", get_registry(), merge=True)
    assert not (tmp_path / "merged" / "adapters").exists()
    plain = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(merged), dtype=torch.float32).eval()
    with torch.no_grad():
        assert_tensor_close(plain(**kwargs).logits, want, "logits of the merged export")
