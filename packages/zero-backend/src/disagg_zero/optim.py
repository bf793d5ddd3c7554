"""The optimizer DeepSpeed steps: AdamW on DeepSpeed's flat fp32 partitions that
behaves, per model parameter, like torch AdamW on the unpartitioned module.

DeepSpeed hands its optimizer one flat tensor per partition, in which the
fragments of many model parameters lie side by side, and zero-fills the
gradient of every element, whether or not its parameter got a gradient. The
single-process reference instead skips a parameter whose gradient is ``None``
(no weight decay, no moment update, no step count) and counts steps per
parameter. :class:`MaskedAdamW` therefore runs torch's own single-tensor AdamW
kernel (``torch.optim.adam.adam``) on each parameter's fragment as a separate
tensor, with that fragment's own step count, and only for parameters that got
a gradient somewhere in the group this step (:attr:`present`, agreed across
ranks by the strategy). AdamW is elementwise, so a fragment updated this way
equals the same elements of the reference's per-parameter update: on CPU with
the single-tensor kernel (``foreach=False``, bit-identical to the reference's
``AdamW(foreach=False)``), on CUDA with the multi-tensor kernel (one launch per
group of fragments instead of one per fragment; the same arithmetic, rounded
alike within an ulp).

DeepSpeed's own clipping is off (it would clip with this group's norm only):
the driver's global clip coefficient scales the gradients here, right before
the update, which is where ``clip_grad_norm_`` scales them in the reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from disagg.interfaces import OptimSpec

#: one parameter's fp32 fragment on this rank: (storage pointer, storage
#: offset, element count, index of the parameter in the trainable list)
Fragment = tuple[int, int, int, int]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _FragmentMask:
    """Which elements of a flat tensor belong to which parameter, and which
    parameters may be updated this step."""

    clip_coef: float = 1.0
    #: per trainable parameter: got a gradient on some rank this step (None: all)
    present: list[bool] | None = None
    fragments: list[Fragment] = []

    def set_fragments(self, fragments: list[Fragment]) -> None:
        self.fragments = sorted(fragments, key=lambda f: (f[0], f[1]))

    def fragments_of(self, flat: torch.Tensor) -> list[tuple[int, int, int]]:
        """(start, numel, parameter index) of each fragment inside ``flat``."""
        ptr, lo, hi = _key(flat), flat.storage_offset(), flat.storage_offset() + flat.numel()
        return [(off - lo, n, i) for p, off, n, i in self.fragments if p == ptr and lo <= off < hi]

    def _scale_grads(self) -> None:
        if self.clip_coef < 1.0:
            for group in self.param_groups:  # type: ignore[attr-defined]
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(self.clip_coef)


class MaskedAdamW(_FragmentMask, torch.optim.AdamW):
    """torch AdamW, per parameter fragment, skipping absent parameters."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        from torch.optim.adam import adam

        self._scale_grads()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for flat in group["params"]:
                if flat.grad is None:
                    continue
                frags = self.fragments_of(flat)
                state = self.state[flat]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
                    # the reference counts steps per parameter (float32, like torch's "step")
                    state["fragment_steps"] = torch.zeros(len(frags), dtype=torch.float32)
                if state["fragment_steps"].numel() != len(frags):
                    raise RuntimeError(
                        f"optimizer state has {state['fragment_steps'].numel()} parameter fragments for a "
                        f"partition that now holds {len(frags)}: the DeepSpeed partition layout changed"
                    )
                views: list[list[torch.Tensor]] = [[], [], [], [], []]
                for k, (start, n, idx) in enumerate(frags):
                    if self.present is not None and not self.present[idx]:
                        continue  # no gradient anywhere: untouched, like a grad=None parameter
                    for out, t in zip(views, (flat, flat.grad, state["exp_avg"], state["exp_avg_sq"])):
                        out.append(t.view(-1).narrow(0, start, n))
                    views[4].append(state["fragment_steps"][k])  # a 0-d view: adam bumps it in place
                if not views[0]:
                    continue
                state["step"] += 1
                # unset (the default): multi-tensor on CUDA, where one launch per
                # fragment is the cost; single-tensor on CPU, bit-identical to the reference
                foreach = group.get("foreach")
                adam(
                    views[0],
                    views[1],
                    views[2],
                    views[3],
                    [],
                    views[4],
                    foreach=flat.is_cuda if foreach is None else bool(foreach),
                    capturable=False,
                    differentiable=False,
                    fused=None,
                    has_complex=False,
                    decoupled_weight_decay=True,
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                )
        return None


class _RestoreAbsent(_FragmentMask):
    """For a vectorised optimizer that steps whole flat tensors
    (DeepSpeedCPUAdam): restore absent parameters' fragments and moments
    afterwards. Their values then match the reference; the step count of a
    flat tensor is shared, so a parameter that gets gradients only in some
    steps sees a different bias correction than in the reference (~1e-7
    relative once steps are many, larger early on)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self._scale_grads()
        saved = []
        for group in self.param_groups:  # type: ignore[attr-defined]
            for flat in group["params"]:
                absent = [
                    (s, n)
                    for s, n, i in self.fragments_of(flat)
                    if self.present is not None and not self.present[i]
                ]
                tensors = [flat] + [v for v in self.state.get(flat, {}).values() if torch.is_tensor(v)]  # type: ignore[attr-defined]
                saved += [
                    (t, s, n, t.view(-1).narrow(0, s, n).clone())
                    for s, n in absent
                    for t in tensors
                    if t.numel() == flat.numel()
                ]
        out = super().step(closure)  # type: ignore[misc]
        for t, s, n, v in saved:
            t.view(-1).narrow(0, s, n).copy_(v)
        return out


def make_masked_adamw(
    params: list[nn.Parameter] | list[dict[str, Any]], optim: OptimSpec, cpu_adam: bool = False
) -> torch.optim.Optimizer:
    """AdamW over ``params`` (parameters or param groups) with ``optim``'s settings.

    ``cpu_adam`` picks DeepSpeed's vectorised CPU AdamW (``adamw_mode``) for
    offloaded optimizer states on GPU runs, where a per-fragment loop would be
    slow; it rounds differently from torch (fp32, ~1e-7 relative per update).
    """
    kw = dict(lr=optim.lr, weight_decay=optim.weight_decay, betas=optim.betas, eps=optim.eps)
    if cpu_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        cls = type("MaskedCPUAdam", (_RestoreAbsent, DeepSpeedCPUAdam), {})
        return cls(params, adamw_mode=True, **kw)
    return MaskedAdamW(params, foreach=None, **kw)


def masked_adamw(
    param_groups: list[dict[str, Any]], optim: OptimSpec, ctx: Any, options: Any
) -> torch.optim.Optimizer:
    """``ZeroStrategy.build_optimizer``: DeepSpeed's CPU AdamW for states
    offloaded from a GPU run (``offload_optimizer``), else :class:`MaskedAdamW`."""
    return make_masked_adamw(
        param_groups, optim, cpu_adam=bool(options.offload_optimizer) and ctx.device.type == "cuda"
    )
