"""The optimizer DeepSpeed steps: AdamW that first applies the driver's clip coefficient.

DeepSpeed's own clipping is off (it would clip with this group's norm only).
The global coefficient is applied to the gradients DeepSpeed hands to the
wrapped optimizer — the reduced, partitioned fp32 gradients — right before the
update, which is exactly where ``clip_grad_norm_`` scales them in the
single-process model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from disagg.interfaces import OptimSpec


class ClipScaled:
    """Mixin: ``step`` multiplies every gradient by ``clip_coef`` first."""

    clip_coef: float = 1.0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.clip_coef < 1.0:
            for group in self.param_groups:  # type: ignore[attr-defined]
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(self.clip_coef)
        return super().step(closure)  # type: ignore[misc]


class ClipScaledAdamW(ClipScaled, torch.optim.AdamW):
    """torch AdamW; with ``foreach=False`` it matches the per-tensor reference
    bit for bit on DeepSpeed's flat partitions (AdamW is elementwise)."""


def make_clip_scaled_adamw(
    params: list[nn.Parameter], optim: OptimSpec, cpu_adam: bool = False
) -> torch.optim.Optimizer:
    """AdamW over ``params`` with ``optim``'s settings.

    ``cpu_adam`` picks DeepSpeed's vectorised CPU AdamW (``adamw_mode``) for
    offloaded optimizer states on GPU runs, where torch's loop would be slow;
    it rounds differently from torch (fp32, ~1e-7 relative per update).
    """
    kw = dict(lr=optim.lr, weight_decay=optim.weight_decay, betas=optim.betas, eps=optim.eps)
    if cpu_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        cls = type("ClipScaledCPUAdam", (ClipScaled, DeepSpeedCPUAdam), {})
        return cls(params, adamw_mode=True, **kw)
    return ClipScaledAdamW(params, foreach=False, **kw)
