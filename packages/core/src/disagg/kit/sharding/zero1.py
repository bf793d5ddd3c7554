"""``shard: optimizer`` (ZeRO-1, torch's ``ZeroRedundancyOptimizer``): each rank keeps the
AdamW state of its own partition of the (whole) parameters; the full form gathers every
partition (checkpoints, export, tests) and a load gives each rank its own again."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def owned(optimizer: Any) -> set[int]:
    """Ids of the parameters whose AdamW state this rank's partition keeps."""
    return {id(p) for g in optimizer.optim.param_groups for p in g["params"]}


def full_state(optimizer: Any, module: nn.Module, rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """Every partition's AdamW state under the module's parameter names, on rank 0 (the
    library's gather; collective: every rank calls it); ``{}`` on the other ranks."""
    names = {id(p): n for n, p in module.named_parameters()}
    optimizer.consolidate_state_dict(to=0)
    if rank != 0:
        return {}
    sd = optimizer.state_dict()
    order = [p for g in optimizer.param_groups for p in g["params"]]
    return {
        names[id(order[i])]: {k: v.detach().cpu().clone() for k, v in st.items() if torch.is_tensor(v)}
        for i, st in sd["state"].items()
    }


def load_partition(
    optimizer: Any, module: nn.Module, optim_state: dict[str, dict[str, torch.Tensor]]
) -> None:
    """The AdamW state of the parameters this rank's partition steps, from the full form."""
    mine = owned(optimizer)
    for name, p in module.named_parameters():
        if id(p) in mine and name in optim_state:
            optimizer.optim.state[p] = {
                # torch AdamW keeps its (non-capturable) step count on the CPU
                k: v.clone() if k == "step" else v.to(p.device, p.dtype).clone()
                for k, v in optim_state[name].items()
            }
