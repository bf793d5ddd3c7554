"""The Hugging Face model trained on the check's batch under the run's precision recipe: what
every strategy must equal.

``Qwen2_5_VLForConditionalGeneration`` loaded from the tiny dir, one sample at a time (no
padding: HF's own forward), loss = sum over label tokens / the batch's label count, one
backward per step, AdamW per parameter (``foreach=False``, as the strategies step on CPU).
Under ``bf16`` the model's weights are bfloat16 (so are its activations) and AdamW steps a
float32 master copy of each weight with the gradient in float32, the recipe's rule
(:mod:`disagg.interfaces.precision`); under ``fp32`` it steps the weights themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from disagg.interfaces import OptimSpec
from disagg.interfaces.precision import RECIPES
from disagg.testing.reference import reference_adamw


@dataclass
class RefRun:
    losses: list[float] = field(default_factory=list)
    #: per step, the gradients (float32) by checkpoint name
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    #: the parameters after the last step (the masters under ``bf16``), by checkpoint name
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: list[float] = field(default_factory=list)


def hf_kwargs(sample: dict[str, dict[str, torch.Tensor]], image_token_id: int, device: torch.device) -> dict:
    """``Qwen2_5_VLForConditionalGeneration``'s keyword arguments for one sample, as its
    processor hands them over (``mm_token_type_ids`` places mRoPE's image rows)."""
    llm = sample["llm"]
    ids = llm["input_ids"][None].to(device)
    kw: dict[str, Any] = {"input_ids": ids, "labels": llm["labels"][None].to(device)}
    if "vision" in sample:
        kw.update(
            pixel_values=sample["vision"]["pixel_values"].to(device),
            image_grid_thw=sample["vision"]["image_grid_thw"].to(device),
            mm_token_type_ids=(ids == image_token_id).int(),
        )
    return kw


def train_hf(
    model_dir: Path,
    samples: list[dict[str, dict[str, torch.Tensor]]],
    steps: int,
    optim: OptimSpec,
    precision: str,
    device: torch.device,
) -> RefRun:
    """``steps`` AdamW steps of the HF model on ``samples`` (one microbatch per step)."""
    import time

    from transformers import Qwen2_5_VLForConditionalGeneration

    recipe = RECIPES[precision]
    # loaded as stored (float32): the masters start from the checkpoint's values, not from
    # their bf16 rounding (as the strategies' masters do), then the weights are cast
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    model.train()  # what the strategies run in (the tiny config has no dropout)
    masters = (
        {n: p.detach().to(recipe.master).clone().requires_grad_(True) for n, p in model.named_parameters()}
        if recipe.master is not None
        else dict(model.named_parameters())
    )
    model.to(recipe.weights)
    params = dict(model.named_parameters())
    opt = reference_adamw(list(masters.values()), optim)
    total = sum(int((s["llm"]["labels"][1:] != -100).sum()) for s in samples)
    out = RefRun()
    for _ in range(steps):
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for s in samples:
            n = int((s["llm"]["labels"][1:] != -100).sum())
            loss = model(**hf_kwargs(s, model.config.image_token_id, device)).loss
            (loss * (n / total)).backward()
            loss_sum += float(loss.detach()) * n
        for n, p in params.items():
            if masters[n] is not p:
                masters[n].grad = None if p.grad is None else p.grad.to(recipe.master)
        out.grads.append(
            {n: m.grad.detach().float().cpu().clone() for n, m in masters.items() if m.grad is not None}
        )
        opt.step()
        if recipe.master is not None:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(masters[n])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.seconds.append(time.perf_counter() - t0)
        out.losses.append(loss_sum / total)
    out.params = {n: m.detach().float().cpu().clone() for n, m in masters.items()}
    return out
