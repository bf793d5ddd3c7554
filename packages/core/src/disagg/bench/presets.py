"""Parallel layouts a bench compares: built-in presets, or a YAML file of them.

A layout is a ``parallel`` section of a train config without the settings
(placement, transport): ``{vision: {strategy, degree, replicas, ...}, llm: {...}}``.
A user extends a preset by writing a YAML file of named layouts
(``examples/bench/layouts.yaml``) and passing ``--layouts FILE``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from disagg.config.errors import ConfigError, Problem


def paper(degree: int, modules: list[str]) -> dict[str, dict[str, Any]]:
    """The published comparison (DHP vs uniform TP vs uniform ZeRO-3); the first is the ratios' baseline."""
    enc = [m for m in modules if m != "llm"]
    tp = {"strategy": "megatron_tp", "degree": degree, "replicas": 1}
    sp = {"strategy": "ulysses", "degree": degree, "replicas": 1}
    # Every tensor of a tiny model sits under DeepSpeed's default persistence
    # threshold (1e5 elements), which keeps it whole on every rank: ZeRO-3 would
    # partition nothing. At 32B only norms and biases are that small; 0 makes
    # the tiny model partition as the large one does.
    z3 = {
        "strategy": "zero",
        "stage": 3,
        "degree": 1,
        "replicas": degree,
        "ds_config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    }
    # Megatron sequence parallelism in the LLM: the paper's DHP with less LLM activation memory.
    tp_sp = {**tp, "sequence_parallel": True}
    # The published run's setting: every module recomputes its blocks in backward.
    rc = {"recompute": "full"}
    return {
        "uniform_tp": {**{m: dict(tp) for m in enc}, "llm": dict(tp)},
        "dhp_ulysses_tp": {**{m: dict(sp) for m in enc}, "llm": dict(tp)},
        "dhp_ulysses_tp_sp": {**{m: dict(sp) for m in enc}, "llm": tp_sp},
        "dhp_ulysses_tp_sp_recompute": {**{m: {**sp, **rc} for m in enc}, "llm": {**tp_sp, **rc}},
        "uniform_zero3": {**{m: dict(z3) for m in enc}, "llm": dict(z3)},
    }


PRESETS = {"paper": paper}


def load_layouts(path: str | Path, modules: list[str]) -> dict[str, dict[str, Any]]:
    """``{name: parallel section}`` from a YAML file with a top-level ``layouts:`` mapping."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError([Problem("--layouts", f"cannot read {path}: {exc}")]) from None
    layouts = (data or {}).get("layouts") if isinstance(data, dict) else None
    if not isinstance(layouts, dict) or not layouts:
        raise ConfigError(
            [
                Problem(
                    "layouts", f"{path}: expected a top-level 'layouts:' mapping of name -> parallel section"
                )
            ]
        )
    problems = []
    for name, parallel in layouts.items():
        if not isinstance(parallel, dict):
            problems.append(
                Problem(f"layouts.{name}", f"{path}: expected a mapping of module -> group, got {parallel!r}")
            )
            continue
        for module in parallel:
            if module not in modules:
                problems.append(
                    Problem(
                        f"layouts.{name}.{module}",
                        f"{path}: no such module in the config; allowed: {', '.join(modules)}",
                    )
                )
    if problems:
        raise ConfigError(problems)
    return layouts


def largest_group(layouts: dict[str, dict[str, Any]]) -> int:
    """Ranks of the largest group (degree x replicas) over every layout: the
    ``d`` a file of layouts is judged by, as ``--degree`` is for a preset."""
    return max(
        int(g.get("degree", 1)) * int(g.get("replicas", 1))
        for parallel in layouts.values()
        for g in parallel.values()
        if isinstance(g, dict)
    )
