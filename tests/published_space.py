"""What the tests of the published setting's plan share (``test_plan_published.py``,
``test_cost_lora.py``): the cluster its verdicts are stated on and the paper's space of LLM layouts."""

from __future__ import annotations

from typing import Any


def tensors_only() -> Any:
    """8 x H100 (``h100x8``) under the tensor-only memory model at all 80 GB: state + gathered +
    saved activations, no allocator terms (the model the paper's verdicts were stated for)."""
    from dataclasses import replace

    from disagg.plan.cluster import PRESETS

    return replace(PRESETS["h100x8"], usable=1.0, cuda_allocator=False)


def paper_space(result: Any) -> list[Any]:
    """The ranking within the paper's LLM layouts (TP, ZeRO-3): since the LLM's FSDP2 estimate
    (issue 37) the planner also ranks ``ddp`` + ``shard`` on the LLM, which the paper never ran
    (at degree 1: it splits the state by sharding, not by degree); the verdicts stated for the
    paper's space are asked among these, the new candidates apart."""
    return [x for x in result.ranked if x.groups["llm"].strategy != "ddp"]
