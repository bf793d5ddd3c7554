"""One layout (a strategy for the vision tower, one for the LLM) at one rank, stepped as core's
worker and driver step it, through the test kit's calls (:mod:`disagg.testing.ranks`): encode
the images, assemble each sample's rows, the LLM's forward and backward (loss sum over the
batch's label count), the tower's backward from the rows' gradients, the group's reduction,
the global norm, each group's optimizer step. Faults are injected here, on request, so the
self-tests run the very code that the checks run."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from disagg.interfaces import OptimSpec
from disagg.testing import ranks

#: what the self-tests inject: ``skip_step`` (step 1's optimizer step not taken: an lr of 0),
#: ``noise_images`` (every image's pixels replaced by noise of the same shape)
FAULTS = ("skip_step", "noise_images")


@dataclass
class Layout:
    """A strategy name and its ``parallel.<module>`` options, per module."""

    name: str
    vision: tuple[str, dict[str, Any]]
    llm: tuple[str, dict[str, Any]]


@dataclass
class StrategyRun:
    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: list[float] = field(default_factory=list)
    #: the FLOPs of a step as the strategies state them (their cost hooks), per module
    flops: dict[str, float] = field(default_factory=dict)


def _strategy(registry: Any, name: str) -> type:
    try:
        return registry.strategies[name]
    except KeyError:
        raise LookupError(
            f"strategy {name!r} is not registered (installed: {', '.join(sorted(registry.strategies))}); "
            "install its plugin (ulysses: disagg-vision-sp, megatron_tp: disagg-llm-tp, zero: "
            "disagg-zero) or exclude its case with --exclude"
        ) from None


#: where each module's parameters sit in ``Qwen2_5_VLForConditionalGeneration`` (transformers 5
#: names): the vision family builds the tower alone, the LLM family the whole model without it
HF_PREFIX = {"vision": "model.visual.", "llm": ""}


def _names(module: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A module's tensors under the HF model's own parameter names, as float32 on the host."""
    return {HF_PREFIX[module] + k: v.detach().float().cpu().clone() for k, v in tensors.items()}


def run_layout(
    layout: Layout,
    registry: Any,
    families: dict[str, Any],
    samples: list[dict[str, dict[str, torch.Tensor]]],
    steps: int,
    optim: OptimSpec,
    precision: str,
    device: torch.device,
    fault: str | None = None,
) -> StrategyRun:
    """``steps`` steps of ``layout`` on ``samples`` (one microbatch per step); ``fault``: one of
    :data:`FAULTS` injected, or None."""
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"fault {fault!r}; allowed: {', '.join(FAULTS)}")
    strats = {}
    for module, (name, options) in (("vision", layout.vision), ("llm", layout.llm)):
        ctx = ranks.rank_context(module, 0, 1, 1, seed=0, device=device, precision=precision)
        opts = {"recompute": "full", **options}
        strats[module] = ranks.strategy_rank(
            _strategy(registry, name), families[module], ctx, options=opts, optim=optim, train=True
        )
    vision, llm = strats["vision"], strats["llm"]
    total = sum(int((s["llm"]["labels"][1:] != -100).sum()) for s in samples)
    with_images = [i for i, s in enumerate(samples) if "vision" in s]
    out = StrategyRun()
    for step in range(steps):
        t0 = time.perf_counter()
        vin = [samples[i]["vision"] for i in with_images]
        if fault == "noise_images":
            g = torch.Generator().manual_seed(100 + step)
            vin = [{**x, "pixel_values": torch.randn(x["pixel_values"].shape, generator=g)} for x in vin]
        vin = [{k: v.to(device) for k, v in x.items()} for x in vin]
        shards = ranks.encode(vision, step, vin)
        rows = {}
        for i, shard in zip(with_images, shards):
            full = torch.empty(shard.total, shard.value.shape[-1], dtype=shard.value.dtype, device=device)
            full[shard.positions.to(device)] = shard.value.detach()
            rows[i] = full
        embeds = ranks.leaves([{"vision": rows[i]} if i in rows else {} for i in range(len(samples))])
        llm_samples = [{k: v.to(device) for k, v in s["llm"].items()} for s in samples]
        loss_sum = ranks.loss_and_backward(llm, step, llm_samples, embeds, 1.0 / total)
        ranks.backward(
            vision,
            step,
            shards,
            [embeds[i]["vision"].grad[s.positions.to(device)] for i, s in zip(with_images, shards)],
        )
        norm_sq = ranks.reduce(vision) + ranks.reduce(llm)  # the global norm over both groups
        grads = {}
        for module, strat in strats.items():
            grads.update(_names(module, ranks.full_grads(strat)))
        out.grads.append(grads)
        for strat in strats.values():
            if fault == "skip_step" and step == 0:
                ranks.zero_grad(strat)  # the injected fault: no update this step
            else:
                ranks.step(strat, norm_sq, None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.seconds.append(time.perf_counter() - t0)
        out.losses.append(loss_sum / total)
    for module, strat in strats.items():
        out.params.update(_names(module, ranks.full_state(strat)))
    return out
