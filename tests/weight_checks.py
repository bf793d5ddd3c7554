"""The weight and resume checks of ``tests/gpu/test_gpu_runs.py``, with the Hugging Face model's
own gradients, shared with their CPU variant (``tests/test_weight_checks_cpu.py``): the logic
the CUDA suite runs is exercised on every CI run, and shown there to fail on injected faults.

Without gradients (``grads=None``) every element gets Adam's hard limit (~2 lr per step) plus,
under the bf16 storage bound, ~3.9 % of its magnitude: a run with no optimizer step at all
passed against a trained one. With the reference's first gradients each element whose gradient
the policy resolves is held to a fraction of lr (:func:`disagg.testing.tolerance.param_bound`),
so a skipped or doubled update, or a resume that lost its checkpoint, fails.

Reference: ``Qwen2_5_VLForConditionalGeneration`` in float32 on the CPU, trained on the run's own
global batches (``hf_reference.train_reference``); its tensors are split into the run's modules
by the HF names the families load from (``disagg.gpucheck.run_strategies.HF_PREFIX``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from disagg.testing.tolerance import Precision, assert_params_close, assert_scalar_close, first_grads

#: where each module's parameters sit in the HF model (transformers 5 names): the vision family
#: builds the tower alone, the LLM family the whole model without it
HF_PREFIX = {"vision": "model.visual."}


def by_module(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """HF-named tensors as ``{module: {name in the module's checkpoint: tensor}}``."""
    out: dict[str, dict[str, torch.Tensor]] = {"vision": {}, "llm": {}}
    prefix = HF_PREFIX["vision"]
    for k, v in tensors.items():
        if k.startswith(prefix):
            out["vision"][k[len(prefix) :]] = v
        else:
            out["llm"][k] = v
    return out


@dataclass
class Reference:
    losses: list[float]
    #: per step, the state after it, per module
    states: list[dict[str, dict[str, torch.Tensor]]]
    #: per step, the gradients (before clipping) of the parameters that got one, per module
    grads: list[dict[str, dict[str, torch.Tensor]]]
    #: the state before the first step, per module
    initial: dict[str, dict[str, torch.Tensor]]

    def first_grads(self, upto: int) -> dict[str, dict[str, torch.Tensor]]:
        """Per module, each parameter's gradient at the first of steps 1..``upto`` it got one."""
        return {m: first_grads([g[m] for g in self.grads[:upto]]) for m in ("vision", "llm")}


def hf_reference(cfg: Any, steps: int) -> Reference:
    """The HF model trained on ``cfg``'s first ``steps`` global batches (Ray must be up: the
    batches are read back from the object store, as the run reads them)."""
    import sys

    from transformers import Qwen2_5_VLForConditionalGeneration

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hf_reference import batches_of, qwen2_5_vl_kwargs, train_reference

    batches = batches_of(cfg, steps)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(cfg.model.llm.path, dtype=torch.float32)
    initial = by_module({k: v.detach().clone() for k, v in model.state_dict().items()})
    run = train_reference(model, batches, qwen2_5_vl_kwargs(model.config.image_token_id), cfg.train)
    return Reference(
        losses=run.losses,
        states=[by_module(s) for s in run.states],
        grads=[by_module(g) for g in run.grads],
        initial=initial,
    )


def _only_keys(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``want`` restricted to the names the checkpoint holds (HF's state dict adds a tied
    ``lm_head.weight`` where the module stores the embedding once)."""
    extra = sorted(set(want) - set(got))
    assert all(k == "lm_head.weight" for k in extra), f"reference names missing from the run: {extra[:5]}"
    return {k: want[k] for k in got}


def assert_weights_match(
    weights: Mapping[str, Mapping[str, torch.Tensor]],
    ref: Reference,
    step: int,
    train: Any,
    precision: Precision,
    what: str = "",
) -> dict[str, float]:
    """A run's weights after ``step`` steps against the reference's, per element in lr units from
    the reference's first gradients. Returns each module's largest margin."""
    want = {m: _only_keys(weights[m], ref.states[step - 1][m]) for m in ("vision", "llm")}
    return _close_per_module(weights, want, ref, step, train, precision, what)


def assert_resume_matches(
    resumed: Mapping[str, Mapping[str, torch.Tensor]],
    uninterrupted: Mapping[str, Mapping[str, torch.Tensor]],
    ref: Reference,
    steps: int,
    train: Any,
    precision: Precision,
    what: str = "",
) -> dict[str, float]:
    """A resumed run's final weights against the uninterrupted run's, both after ``steps``: the
    same per-element bound as :func:`assert_weights_match` (both sides start from the same weights
    and take the same updates; the reference's gradients say how far each element may differ),
    so a resume that lost its checkpoint (an update missing) fails."""
    return _close_per_module(resumed, uninterrupted, ref, steps, train, precision, what)


def _close_per_module(
    got: Mapping[str, Mapping[str, torch.Tensor]],
    want: Mapping[str, Mapping[str, torch.Tensor]],
    ref: Reference,
    step: int,
    train: Any,
    precision: Precision,
    what: str,
) -> dict[str, float]:
    """Each module's ``got`` against ``want`` after ``step`` steps, per element in lr units from
    the reference's first gradients; each module's largest margin."""
    grads = ref.first_grads(step)
    return {
        m: assert_params_close(
            got[m],
            want[m],
            lr=train.lr,
            steps=step,
            grads=grads[m],
            what=f"{what}{m} after step {step}: ",
            precision=precision,
            betas=tuple(train.betas),
            eps=train.eps,
        )
        for m in ("vision", "llm")
    }


def assert_losses_match(losses: list[float], ref: Reference, precision: Precision, what: str = "") -> None:
    assert len(losses) == len(ref.losses), (losses, ref.losses)
    for step, (got, want) in enumerate(zip(losses, ref.losses), 1):
        assert_scalar_close(got, want, f"{what}step {step} loss", precision)


def run_config(
    tiny: dict,
    out: Path,
    vision: dict,
    llm: dict,
    device: str,
    precision: str,
    steps: int,
    transport: str = "auto",
    **extra: Any,
) -> Any:
    """The tiny Qwen2.5-VL run of the GPU suite, on ``device`` in ``precision``, both groups
    collocated; ``extra``: ``section__key=value`` overrides (e.g. ``checkpoint__every=1``)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from e2e_run import e2e_config

    family = "qwen2_5_vl"
    families = {"vision": (family, family), "llm": (family, family)}
    parallel = {"vision": vision, "llm": llm, "placement": "collocated", "transport": transport}
    cfg = e2e_config(tiny, out, families, parallel, steps)
    raw = cfg.model_dump(mode="json")
    raw["train"].update(device=device, precision=precision)
    for key, value in extra.items():
        section, name = key.split("__")
        raw[section][name] = value
    return type(cfg).model_validate(raw)
