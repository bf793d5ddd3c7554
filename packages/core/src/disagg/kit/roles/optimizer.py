"""How a strategy's optimizer and schedule are made: ``Strategy.build_optimizer``
is a plain callable (param groups, the module's optimizer spec, the rank's
context) so a strategy that needs another optimizer names one instead of
rewriting its set-up."""

from __future__ import annotations

from typing import Any, Callable

import torch

from disagg.interfaces.context import GroupContext, OptimSpec
from disagg.kit.offload import host_adamw_kernel, offloaded

#: ``(param_groups, optim, ctx, options) -> optimizer``; ``options`` are the strategy's
OptimizerBuilder = Callable[[list[dict[str, Any]], OptimSpec, GroupContext, Any], torch.optim.Optimizer]


def adamw(
    param_groups: list[dict[str, Any]], optim: OptimSpec, ctx: GroupContext, options: Any = None
) -> torch.optim.Optimizer:
    """torch AdamW with the module's settings (every first-party strategy but ``zero``)."""
    # CPU: foreach=False keeps the update bit-identical to the per-tensor
    # reference. CUDA: the fused kernel (one launch for all tensors; bf16
    # runs are compared within a tolerance anyway).
    kernel = {"fused": True} if ctx.device.type == "cuda" else {"foreach": False}
    if offloaded(options):  # the state is in host memory: a host kernel
        kernel = host_adamw_kernel(ctx.device)
    return torch.optim.AdamW(
        param_groups,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=optim.betas,
        eps=optim.eps,
        **kernel,
    )


def make_scheduler(optimizer: torch.optim.Optimizer, optim: OptimSpec) -> Any:
    """A ``transformers.get_scheduler`` schedule stepped once per optimizer step."""
    from transformers import get_scheduler

    return get_scheduler(
        optim.scheduler,
        optimizer=optimizer,
        num_warmup_steps=optim.warmup_steps,
        num_training_steps=max(optim.total_steps, 1),
    )
