"""``shard: optimizer`` (ZeRO-1): the optimizer a sharded replica builds, torch's
``ZeroRedundancyOptimizer`` around AdamW (plain AdamW under any other mode)."""

from __future__ import annotations

from typing import Any

import torch

from disagg.interfaces.context import GroupContext, OptimSpec
from disagg.kit.offload import host_adamw_kernel, offloaded
from disagg.kit.roles.optimizer import adamw


def build_optimizer(
    param_groups: list[dict[str, Any]], optim: OptimSpec, ctx: GroupContext, options: Any = None
) -> torch.optim.Optimizer:
    """AdamW; under ``shard: optimizer`` inside ``ZeroRedundancyOptimizer`` (ZeRO-1)."""
    if getattr(options, "shard", "none") != "optimizer" or ctx.world_size == 1:
        return adamw(param_groups, optim, ctx, options)
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    kernel = {"fused": True} if ctx.device.type == "cuda" else {"foreach": False}
    if offloaded(options):  # each rank's partition of the state is in host memory
        kernel = host_adamw_kernel(ctx.device)
    # its broadcasts on a group of their own (collective: every rank builds it)
    group = dist.new_group(list(range(ctx.world_size)), timeout=ctx.collective_timeout)
    return ZeroRedundancyOptimizer(
        param_groups,
        optimizer_class=torch.optim.AdamW,
        process_group=group,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=optim.betas,
        eps=optim.eps,
        **kernel,
    )
