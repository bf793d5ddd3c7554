"""The values of ``parallel.<module>.shard`` and what each cannot do with a family and options
(refused at validation, by the strategy's ``check``)."""

from __future__ import annotations

from typing import Any, Literal

from disagg.interfaces.family import Family

ShardMode = Literal["none", "optimizer", "gradients", "parameters"]
MODES: tuple[str, ...] = ("none", "optimizer", "gradients", "parameters")
FSDP_MODES: tuple[str, ...] = ("gradients", "parameters")


def module_key(family: Family) -> str:
    if family.role == "llm":
        return "llm"
    return "audio" if getattr(family, "modality", "image") == "audio" else "vision"


def shard_problems(family: Family, options: Any) -> list[str]:
    """What ``parallel.<module>.shard`` cannot do with this family and these options."""
    mode = getattr(options, "shard", "none")
    if mode == "none":
        return []
    key = f"parallel.{module_key(family)}"
    problems = []
    if getattr(options, "overlap_grad_reduce", False):
        problems.append(
            f"{key}.overlap_grad_reduce: true cannot be combined with {key}.shard: {mode} "
            "(the sharded state is reduced by ZeroRedundancyOptimizer/FSDP2 itself); "
            "set overlap_grad_reduce: false, or shard: none"
        )
    # an LLM replica without samples runs a one-token placeholder (disagg.kit.lockstep); an
    # encoder's placeholder is an image
    if mode in FSDP_MODES and family.role != "llm" and getattr(family, "modality", "image") != "image":
        problems.append(
            f"{key}.shard: {mode}: a rank without samples runs a placeholder image forward, which "
            f"family {family.name!r} ({family.modality}) has none of; allowed: none, optimizer"
        )
    return problems
