"""The ``zero`` strategy's state in and out: the layout-free full form
(weights, AdamW moments and step counts, gradients) that ``checkpoint.format: full``,
export and the tests go through (a sharded checkpoint's per-rank pieces:
:mod:`disagg_zero.layout`).

A component of :class:`disagg_zero.strategy.ZeroStrategy` (its ``full``), kept apart because
it talks to DeepSpeed's partitions (``safe_get_full_*``/``safe_set_full_*`` and their ZeRO-3
padding) while the strategy file is about the step. It reads its strategy's ``module``,
``engine``, ``optimizer``, ``options``, ``ctx``, ``_params`` and ``_present``; without an
engine (stages 1-2 frozen: nothing partitioned) the strategy keeps the kit's default load.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from disagg_zero import runtime

if TYPE_CHECKING:
    from disagg_zero.strategy import ZeroStrategy


class ZeroFullState:
    """Full-form state of a :class:`~disagg_zero.strategy.ZeroStrategy` (``owner``) in
    DeepSpeed's partitions; its sharded checkpoints' pieces come from
    :class:`~disagg_zero.layout.ZeroLayout`, which uses the helpers here."""

    def __init__(self, owner: ZeroStrategy) -> None:
        self.owner = owner

    # the strategy's, as DeepSpeed has set them up (read at each call)
    @property
    def module(self) -> nn.Module:
        assert self.owner.module is not None
        return self.owner.module

    @property
    def engine(self) -> Any:
        return self.owner.engine

    @property
    def optimizer(self) -> Any:
        return self.owner.optimizer

    @property
    def stage(self) -> int:
        return self.owner.options.stage

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state with, under ``bf16``, each trainable weight as DeepSpeed's fp32
        master (the recipe's full form, what a checkpoint holds), not its bf16 copy."""
        with runtime.gathered(self.module, self.stage, self.engine is not None):
            out = {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}
        recipe = self.owner.ctx.recipe
        if self.engine is None or self.optimizer is None or recipe is None or recipe.master is None:
            return out
        masters = runtime.full_masters(self.owner._params)  # collective, the same order everywhere
        for name, t in self.module.state_dict(keep_vars=True).items():
            if id(t) in masters:  # a tied weight under each of its names
                out[name] = masters[id(t)]
        return out

    def grads(self) -> dict[str, torch.Tensor]:
        if self.engine is None or self.optimizer is None:
            return {}
        from deepspeed.utils import safe_get_full_grad

        params = self.owner._params
        present = dict(zip(map(id, params), self.owner._present or [False] * len(params)))
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

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Full AdamW moments per parameter through DeepSpeed's
        ``safe_get_full_optimizer_state`` (collective, same order on every
        rank); the step count per parameter from :class:`MaskedAdamW`'s
        fragment steps, the largest over the group (a rank may hold no
        fragment of a parameter)."""
        if self.engine is None or self.optimizer is None:
            return {}
        from deepspeed.utils import safe_get_full_optimizer_state

        steps = self.param_steps()
        if not any(steps):
            return {}  # never stepped: DeepSpeed's optimizer has no state yet
        self.link_optimizer_state()
        out = {}
        for (name, p), step in zip(self.named_params(), steps):
            if step == 0:
                continue
            shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape
            out[name] = {
                k: safe_get_full_optimizer_state(p, k).detach().float().cpu().view(shape).clone()
                for k in ("exp_avg", "exp_avg_sq")
            }
            out[name]["step"] = torch.tensor(float(step))
        return out

    def load(self, params: dict[str, torch.Tensor], optim_state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Weights into DeepSpeed's fp32 master partitions
        (``safe_set_full_fp32_param``) and the module's own parameters, moments
        through ``safe_set_full_optimizer_state``, step counts into this rank's
        fragments (an engine is set up)."""
        ctx = self.owner.ctx
        named = dict(self.module.named_parameters())
        missing = [n for n in named if n not in params]
        if missing:
            raise KeyError(f"checkpoint has no tensor {missing[0]!r} for module {ctx.module!r}")
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
            for name, p in self.named_params():
                self._set_full(p, params[name].to(ctx.device, torch.float32), None)
            if not optim_state:
                return
            self.init_optimizer_state()
            self.link_optimizer_state()
            for name, p in self.named_params():
                st = optim_state.get(name)
                for k in ("exp_avg", "exp_avg_sq"):
                    value = st[k] if st else torch.zeros(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
                    self._set_full(p, value.to(ctx.device, torch.float32), k)
            self.set_steps(
                [float(optim_state[n]["step"]) if n in optim_state else 0.0 for n, _ in self.named_params()]
            )

    def set_steps(self, steps: list[float]) -> None:
        """Per trainable parameter, its AdamW step count into this rank's fragments of it."""
        for flat, state in self.optimizer.state.items():
            frags = self.optimizer.fragments_of(flat)
            state["fragment_steps"] = torch.tensor([steps[i] for _, _, i in frags], dtype=torch.float32)
            state["step"] = torch.tensor(max([steps[i] for _, _, i in frags], default=0.0))

    def _set_full(self, p: nn.Parameter, value: torch.Tensor, key: str | None) -> None:
        """This rank's part of a full fp32 master weight (``key=None``) or
        optimizer state, through DeepSpeed's ``safe_set_full_*``."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        opt = self.engine.optimizer
        if self.stage == 3 and p.ds_numel % opt._get_param_partition_world_size(p):  # noqa: SLF001
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
        if self.stage < 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=0)

    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        """The trainable parameters, named, in the strategy's order."""
        ids = {id(p) for p in self.owner._params}
        return [(n, p) for n, p in self.module.named_parameters() if id(p) in ids]

    def param_steps(self) -> list[float]:
        """Per trainable parameter, its AdamW step count (max over the group)."""
        import torch.distributed as dist

        steps = torch.zeros(len(self.owner._params), dtype=torch.float64, device=self.owner.ctx.device)
        for flat, state in self.optimizer.state.items():
            # DeepSpeedCPUAdam (offload) counts steps per flat tensor, not per fragment
            per_frag = state.get("fragment_steps")
            for k, (_, _, i) in enumerate(self.optimizer.fragments_of(flat)):
                got = per_frag[k] if per_frag is not None else state.get("step", 0)
                steps[i] = max(float(steps[i]), float(got))
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        return steps.cpu().tolist()

    def init_optimizer_state(self) -> None:
        """Create :class:`MaskedAdamW`'s state as its first step would (zero
        moments, no steps), so that DeepSpeed can address it."""
        # DeepSpeed swaps its flat partitions in and out of the param groups
        # around each step (ZeRO-3 sub-groups): address them directly
        ds = self.engine.optimizer
        flats = ds.fp32_partitioned_groups_flat if self.stage == 3 else runtime.master_partitions(ds)
        for flat in flats:
            state = self.optimizer.state[flat]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
                n = len(self.optimizer.fragments_of(flat))
                state["fragment_steps"] = torch.zeros(n, dtype=torch.float32)

    def link_optimizer_state(self) -> None:
        """ZeRO 1-2 point each parameter's fragment at the optimizer state
        lazily, at its first step; a state created here needs the same link."""
        opt = self.engine.optimizer
        if self.stage < 3 and hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
            opt._hp_optimizer_states_linked = False  # noqa: SLF001
            opt._lazy_init_hp_params_optimizer_state()  # noqa: SLF001
