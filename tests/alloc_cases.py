"""Rank functions of ``test_allocator_peak`` (spawned ranks import them by module name): each
first-party strategy built and stepped twice on the tiny Qwen2.5-VL inside one allocator trace
(:mod:`disagg.testing.allocator`), the window around the second step (the first one has made
AdamW's moments, as every step after it finds them)."""

from __future__ import annotations

from typing import Any

import flops_cases as F
import torch

from disagg.testing import ranks
from disagg.testing.allocator import trace

#: the cases of ``test_flops_measured`` (each strategy on a 2-rank group) and its inputs
CASES = F.CASES


def _step(strat: Any, module: str, mine: list[int], images: list, llm: tuple) -> None:
    """One optimizer step of this rank's samples, as core's worker runs it."""
    if module == "llm":
        samples, embeds = llm
        ranks.loss_and_backward(
            strat, 0, [samples[i] for i in mine], ranks.leaves([embeds[i] for i in mine]), 1.0
        )
    else:
        shards = ranks.encode(strat, 0, [images[i] for i in mine])
        ranks.backward(strat, 0, shards, [torch.ones_like(s.value) for s in shards])
        del shards
    ranks.finish_step(strat, max_norm=1.0)


def _case(reg: Any, path: str, rank: int, world: int, case: tuple, images: list, llm: tuple) -> dict:
    name, module, degree, replicas, options = case
    family = reg.family("llm" if module == "llm" else "encoder", F.FAMILY)(path, {})
    ctx = ranks.rank_context(module, rank, degree, replicas)
    mine = [rank] if replicas == world else list(range(len(images)))  # replicas: a sample each

    def build() -> Any:
        strat = ranks.strategy_rank(reg.strategies[name], family, ctx, options=options, train=True)
        _step(strat, module, mine, images, llm)  # AdamW's moments exist from here on
        return strat

    strat, peak = trace(build, lambda s: _step(s, module, mine, images, llm))
    return {
        "case": (name, module, degree, replicas),
        "samples": mine,
        "baseline": peak.baseline,
        "peak": peak.peak,
        "records": peak.records,
        "state_bytes": ranks.state_bytes(strat),
    }


def rank_peaks(rank: int, path: str, world: int = 2) -> list[dict[str, Any]]:
    """Per case of :data:`CASES`, this rank's live-allocation peak during its second step."""
    from disagg.plugins import get_registry

    reg = get_registry()
    images, llm = F.vision_inputs(path), F.llm_inputs(path)
    return [_case(reg, path, rank, world, case, images, llm) for case in CASES]
