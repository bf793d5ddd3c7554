"""Each vision-language family end to end through ``run_training`` against its
single-process Hugging Face ``ForConditionalGeneration`` model, at every step,
on the mixed dataset (image sizes, a two-image sample, text-only samples and
a text-only global batch; two microbatches; weight decay on).

Layouts: the published one (vision ``ulysses`` 2 + LLM ``megatron_tp`` 2),
and both modules under ``megatron_tp`` 2 (the vision family's TP layer map).
``qwen2_5_vl`` and the SigLIP ``llava`` are covered by test_e2e_mixes and
test_e2e_llava; this file runs the families added after them: ``qwen2_vl``,
``qwen3_vl`` (DeepStack features included) and the CLIP-tower ``llava``
(llava-1.5).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

from hf_reference import (  # noqa: E402
    assert_run_matches_reference,
    batches_of,
    pixel_values_kwargs,
    qwen2_5_vl_kwargs,
    train_reference,
)
from mixed_data import make_mixed_tiny, mixed_config  # noqa: E402

from disagg.config.schema import Config  # noqa: E402
from disagg.config.validate import validate
from disagg.plugins import get_registry

STEPS = 3


def _qwen_kwargs(cfg) -> Callable[[dict], dict]:  # noqa: ANN001
    return qwen2_5_vl_kwargs(cfg.image_token_id)  # Qwen2-VL and Qwen3-VL take the same keywords


def _llava_kwargs(cfg) -> Callable[[dict], dict]:  # noqa: ANN001
    return pixel_values_kwargs


@dataclass(frozen=True)
class Case:
    tiny: str  # make-tiny name of the whole-VLM dir
    vision: str
    llm: str
    hf_class: str  # transformers class of the whole model
    kwargs: Callable


CASES = {
    "qwen2_vl": Case("qwen2_vl", "qwen2_vl", "qwen2_vl", "Qwen2VLForConditionalGeneration", _qwen_kwargs),
    # DeepStack features travel as extra columns of the image rows (see the qwen3_vl families)
    "qwen3_vl": Case("qwen3_vl", "qwen3_vl", "qwen3_vl", "Qwen3VLForConditionalGeneration", _qwen_kwargs),
    # llava-1.5: CLIP tower (CLS token dropped from the features) + Llama
    "llava_clip": Case(
        "llava_clip",
        "llava",
        "llama",
        "LlavaForConditionalGeneration",
        _llava_kwargs,
    ),
}
#: make-tiny family that writes each case's dir
MAKE = {"qwen2_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl", "llava_clip": "llava"}

LAYOUTS = {
    "ulysses2+tp2": ({"strategy": "ulysses", "degree": 2}, {"strategy": "megatron_tp", "degree": 2}),
    "tp2+tp2": ({"strategy": "megatron_tp", "degree": 2}, {"strategy": "megatron_tp", "degree": 2}),
}


def _config(tiny: dict, case: Case, out: Path, vision: dict, llm: dict) -> Config:
    path = tiny["models"][case.tiny]
    model = {"vision": {"family": case.vision, "path": path}, "llm": {"family": case.llm, "path": path}}
    return mixed_config(model, {"vision": vision, "llm": llm}, tiny, out, STEPS)


@pytest.fixture(scope="module", params=list(CASES))
def family(request, ray_local, tmp_path_factory):
    """The tiny dir, its HF reference run (once per family) and the case."""
    import transformers

    case = CASES[request.param]
    tiny = make_mixed_tiny(tmp_path_factory.mktemp("tiny"), MAKE[request.param])
    ddp = {"strategy": "ddp"}
    cfg = _config(tiny, case, tmp_path_factory.mktemp("ref"), ddp, ddp)
    batches = batches_of(cfg, STEPS)
    assert [all("vision" not in s for s in b) for b in batches] == [False, True, False]
    cls = getattr(transformers, case.hf_class)
    model = cls.from_pretrained(tiny["models"][case.tiny], dtype=torch.float32)
    return case, tiny, train_reference(model, batches, case.kwargs(model.config), cfg.train)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_family_equals_hf_model_every_step(ray_local, family, tmp_path, layout):
    import transformers

    from disagg.runtime.run import run_training

    case, tiny, want = family
    vision, llm = LAYOUTS[layout]
    run = tmp_path / "run"
    cfg = _config(tiny, case, run, vision, llm)
    run_training(validate(cfg, get_registry()), progress=False)
    assert len(want.losses) == STEPS
    # parameters in units of the learning rate, per element, from the reference's own first
    # gradients (a key bias whose exact gradient is 0, CLIP's, is decided by its gradient, not its name)
    hf_class = getattr(transformers, case.hf_class)
    assert_run_matches_reference(run, want, cfg.train, hf_class, f"{case.tiny} {layout}")
