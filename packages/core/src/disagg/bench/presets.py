"""Parallel layouts compared by the published result (DHP vs uniform TP vs uniform ZeRO-3)."""

from __future__ import annotations

from typing import Any


def paper(degree: int, modules: list[str]) -> dict[str, dict[str, Any]]:
    """``parallel`` sections per variant; the first is the baseline of the ratios."""
    enc = [m for m in modules if m != "llm"]
    tp = {"strategy": "megatron_tp", "degree": degree, "replicas": 1}
    sp = {"strategy": "ulysses", "degree": degree, "replicas": 1}
    z3 = {"strategy": "zero", "stage": 3, "degree": 1, "replicas": degree}
    # Megatron sequence parallelism in the LLM: the paper's DHP with less LLM activation memory.
    tp_sp = {**tp, "sequence_parallel": True}
    return {
        "uniform_tp": {**{m: dict(tp) for m in enc}, "llm": dict(tp)},
        "dhp_ulysses_tp": {**{m: dict(sp) for m in enc}, "llm": dict(tp)},
        "dhp_ulysses_tp_sp": {**{m: dict(sp) for m in enc}, "llm": tp_sp},
        "uniform_zero3": {**{m: dict(z3) for m in enc}, "llm": dict(z3)},
    }


PRESETS = {"paper": paper}
