"""The ``zero`` strategy's state in and out: the layout-free full form
(weights, AdamW moments and step counts, gradients) that ``checkpoint.format: full``,
export and the tests go through (a sharded checkpoint's per-rank pieces:
:mod:`disagg_zero.layout`).

A mixin of :class:`disagg_zero.strategy.ZeroStrategy`, kept apart because it
talks to DeepSpeed's partitions (``safe_get_full_*``/``safe_set_full_*`` and
their ZeRO-3 padding) while the strategy file is about the step. It uses the
strategy's ``module``, ``engine``, ``optimizer``, ``scheduler``, ``options``,
``ctx``, ``_params``, ``_present`` and ``_map_fragments``; it comes before
:class:`~disagg.kit.Strategy` in the bases, so its ``super()`` calls
reach core's plain-module versions (no engine: nothing to partition).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from disagg_zero import runtime
from disagg_zero.layout import ZeroLayout


class ZeroFullState(ZeroLayout):
    """Full-form state for :class:`ZeroStrategy`; its sharded
    checkpoints' pieces come from :class:`~disagg_zero.layout.ZeroLayout`."""

    module: nn.Module | None
    engine: Any
    optimizer: Any
    scheduler: Any
    options: Any
    ctx: Any
    _params: list[nn.Parameter]
    _present: list[bool] | None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        with runtime.gathered(self.module, self.options.stage, self.engine is not None):
            return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        if self.engine is None or self.optimizer is None:
            return {}
        from deepspeed.utils import safe_get_full_grad

        present = dict(zip(map(id, self._params), self._present or [False] * len(self._params)))
        out = {}
        for name, p in self.module.named_parameters():
            # collective: every rank, same order; a parameter with no gradient
            # anywhere is None in the reference, so it is left out here too
            if p.requires_grad and present[id(p)]:
                g = safe_get_full_grad(p)
                if g is not None:
                    out[name] = (
                        g.detach().float().cpu().view(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
                    )
        return out

    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Full AdamW moments per parameter through DeepSpeed's
        ``safe_get_full_optimizer_state`` (collective, same order on every
        rank); the step count per parameter from :class:`MaskedAdamW`'s
        fragment steps, the largest over the group (a rank may hold no
        fragment of a parameter)."""
        if self.engine is None or self.optimizer is None:
            return {}
        from deepspeed.utils import safe_get_full_optimizer_state

        steps = self._param_steps()
        if not any(steps):
            return {}  # never stepped: DeepSpeed's optimizer has no state yet
        self._link_optimizer_state()
        out = {}
        for (name, p), step in zip(self._named_params(), steps):
            if step == 0:
                continue
            shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape
            out[name] = {
                k: safe_get_full_optimizer_state(p, k).detach().float().cpu().view(shape).clone()
                for k in ("exp_avg", "exp_avg_sq")
            }
            out[name]["step"] = torch.tensor(float(step))
        return out

    def load_full_state(
        self, params: dict[str, torch.Tensor], optim_state: dict[str, dict[str, torch.Tensor]]
    ) -> None:
        """Weights into DeepSpeed's fp32 master partitions
        (``safe_set_full_fp32_param``) and the module's own parameters, moments
        through ``safe_set_full_optimizer_state``, step counts into this rank's
        fragments."""
        assert self.module is not None
        if self.engine is None:
            super().load_full_state(params, {})
            return
        named = dict(self.module.named_parameters())
        missing = [n for n in named if n not in params]
        if missing:
            raise KeyError(f"checkpoint has no tensor {missing[0]!r} for module {self.ctx.module!r}")
        with torch.no_grad():
            # every rank holds the full values; ZeRO-3 re-partitions rank 0's on leaving
            with self._modifiable():
                for name, p in named.items():
                    p.copy_(params[name].to(p.device, p.dtype))
                for name, b in self.module.named_buffers():
                    if name in params:
                        b.copy_(params[name].to(b.device, b.dtype))
            if self.optimizer is None:
                return
            for name, p in self._named_params():
                self._set_full(p, params[name].to(self.ctx.device, torch.float32), None)
            if not optim_state:
                return
            self._init_optimizer_state()
            self._link_optimizer_state()
            for name, p in self._named_params():
                st = optim_state.get(name)
                for k in ("exp_avg", "exp_avg_sq"):
                    value = st[k] if st else torch.zeros(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
                    self._set_full(p, value.to(self.ctx.device, torch.float32), k)
            self._set_steps(
                [float(optim_state[n]["step"]) if n in optim_state else 0.0 for n, _ in self._named_params()]
            )

    def _set_steps(self, steps: list[float]) -> None:
        """Per trainable parameter, its AdamW step count into this rank's fragments of it."""
        for flat, state in self.optimizer.state.items():
            frags = self.optimizer.fragments_of(flat)  # type: ignore[attr-defined]
            state["fragment_steps"] = torch.tensor([steps[i] for _, _, i in frags], dtype=torch.float32)
            state["step"] = torch.tensor(max([steps[i] for _, _, i in frags], default=0.0))

    def _set_full(self, p: nn.Parameter, value: torch.Tensor, key: str | None) -> None:
        """This rank's part of a full fp32 master weight (``key=None``) or
        optimizer state, through DeepSpeed's ``safe_set_full_*``."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        opt = self.engine.optimizer
        if self.options.stage == 3 and p.ds_numel % opt._get_param_partition_world_size(p):  # noqa: SLF001
            # DeepSpeed's ZeRO-3 setter slices the unpadded value past its end on
            # the last rank when the parameter does not split evenly: do its copy
            # with the padding left at zero
            part, _ = opt._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)  # noqa: SLF001
            start = part.numel() * opt._get_param_partition_rank(p)  # noqa: SLF001
            piece = value.flatten()[start : start + part.numel()]
            part.data.zero_()
            part.data[: piece.numel()].copy_(piece)
        elif key is None:
            safe_set_full_fp32_param(p, value)
        else:
            safe_set_full_optimizer_state(p, value, key)

    def _modifiable(self) -> contextlib.AbstractContextManager:
        if self.options.stage < 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=0)  # type: ignore[union-attr]

    def _named_params(self) -> list[tuple[str, nn.Parameter]]:
        ids = {id(p) for p in self._params}
        return [(n, p) for n, p in self.module.named_parameters() if id(p) in ids]  # type: ignore[union-attr]

    def _param_steps(self) -> list[float]:
        """Per trainable parameter, its AdamW step count (max over the group)."""
        import torch.distributed as dist

        steps = torch.zeros(len(self._params), dtype=torch.float64, device=self.ctx.device)
        for flat, state in self.optimizer.state.items():  # type: ignore[union-attr]
            # DeepSpeedCPUAdam (offload) counts steps per flat tensor, not per fragment
            per_frag = state.get("fragment_steps")
            for k, (_, _, i) in enumerate(self.optimizer.fragments_of(flat)):  # type: ignore[union-attr]
                got = per_frag[k] if per_frag is not None else state.get("step", 0)
                steps[i] = max(float(steps[i]), float(got))
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        return steps.cpu().tolist()

    def _init_optimizer_state(self) -> None:
        """Create :class:`MaskedAdamW`'s state as its first step would (zero
        moments, no steps), so that DeepSpeed can address it."""
        # DeepSpeed swaps its flat partitions in and out of the param groups
        # around each step (ZeRO-3 sub-groups): address them directly
        ds = self.engine.optimizer
        flats = ds.fp32_partitioned_groups_flat if self.options.stage == 3 else runtime.master_partitions(ds)
        for flat in flats:
            state = self.optimizer.state[flat]  # type: ignore[union-attr]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
                n = len(self.optimizer.fragments_of(flat))  # type: ignore[union-attr]
                state["fragment_steps"] = torch.zeros(n, dtype=torch.float32)

    def _link_optimizer_state(self) -> None:
        """ZeRO 1-2 point each parameter's fragment at the optimizer state
        lazily, at its first step; a state created here needs the same link."""
        opt = self.engine.optimizer
        if self.options.stage < 3 and hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
            opt._hp_optimizer_states_linked = False  # noqa: SLF001
            opt._lazy_init_hp_params_optimizer_state()  # noqa: SLF001
