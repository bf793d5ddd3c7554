"""``zero``: DeepSpeed ZeRO stages 1, 2 and 3 for any module (degree 1, replicas = ranks).

How one step maps onto the DeepSpeed engine:

* forward runs *through* the engine (``engine(fn)`` with a pass-through root
  module, :class:`_Runner`), so that its forward prologue and ZeRO-3's
  parameter gathering hooks run while the family's own code drives the HF
  module;
* every backward is a non-boundary micro-step (stages 2-3 reduce-scatter in
  their hooks, stage 1 keeps local gradients); :meth:`reduce_gradients` marks
  the boundary and finishes the reduction, once per optimizer step, however
  many microbatches there were;
* the group's norm comes from DeepSpeed's partitioned fp32 gradients, and the
  driver's clip coefficient is applied to those same gradients by the
  optimizer DeepSpeed steps (:class:`disagg_zero.optim.ClipScaled`), since
  DeepSpeed's own clipping is off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from disagg.interfaces import EmbeddingShard, EncoderFamily, Family, LanguageFamily, OptimSpec, Strategy
from disagg.interfaces.strategy import make_scheduler
from disagg_zero import runtime
from disagg_zero.dsconfig import backward_scale, build_ds_config, zero_section_problems
from disagg_zero.optim import make_clip_scaled_adamw
from disagg_zero.options import ZeroOptions

CHECKPOINT_TAG = "zero"


class _Runner(nn.Module):
    """Root module handed to DeepSpeed: calls ``fn(inner, *args)`` so families
    keep calling the Hugging Face module itself."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.inner, *args)


class ZeroStrategy(Strategy):
    """Data parallelism with ZeRO-partitioned optimizer states (1), gradients (2)
    and parameters (3), through ``deepspeed.initialize``."""

    name: ClassVar[str] = "zero"
    distribution: ClassVar[str] = "disagg-zero"
    options_model: ClassVar[type[ZeroOptions]] = ZeroOptions  # type: ignore[assignment]
    # DeepSpeed reduces gradients inside backward (stage 2) and gathers
    # parameters inside forward (stage 3): every rank must run every microbatch.
    lockstep: ClassVar[bool] = True

    @classmethod
    def check(cls, family: Family, degree: int, replicas: int, options: ZeroOptions) -> list[str]:  # type: ignore[override]
        problems = []
        if degree != 1:
            problems.append(
                f"strategy 'zero' shards state across replicas, not samples: degree must be 1, got {degree}; "
                f"use replicas={degree * replicas} for the same number of ranks"
            )
        return problems + zero_section_problems(options)

    def __init__(self, ctx: Any, family: Family, options: ZeroOptions) -> None:  # type: ignore[override]
        super().__init__(ctx, family, options)
        self.options: ZeroOptions = options
        self.engine: Any = None
        self._seed_scale = backward_scale(options, ctx.world_size)

    # -- setup ------------------------------------------------------------------------------------
    def parallelize(self, module: nn.Module) -> nn.Module:
        # The engine (built in setup, where the optimizer exists) does the wrapping.
        return module

    def setup(self, module: nn.Module, optim: OptimSpec | None) -> None:
        deepspeed = runtime.prepare(self.ctx)
        if self.options.activation_checkpointing:
            runtime.enable_activation_checkpointing(module, self.family)
        self.module = module.to(self.ctx.device)
        config = build_ds_config(self.options, self.ctx.dtype)
        if optim is None:
            module.requires_grad_(False)
            if self.options.stage < 3:
                # Nothing to shard without optimizer states or gradients.
                return
        else:
            self.optimizer = make_clip_scaled_adamw(
                self.trainable_parameters(),
                optim,
                cpu_adam=self.options.offload_optimizer and self.ctx.device.type == "cuda",
            )
            self.scheduler = make_scheduler(self.optimizer, optim)
        where = f"parallel.{self.ctx.module}"
        with runtime.config_errors(where):
            self.engine, *_ = deepspeed.initialize(
                model=_Runner(self.module),
                optimizer=self.optimizer,
                lr_scheduler=self.scheduler,
                config=config,
                dist_init_required=False,
            )

    # -- forward / backward -----------------------------------------------------------------------
    def _forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.engine is None:
            return fn(self.module, *args)
        self._forwards = getattr(self, "_forwards", 0) + 1
        return self.engine(fn, *args)

    def _count_comm(self) -> None:
        """DeepSpeed's collectives are internal, so count what ZeRO moves per
        step analytically (ring algorithms: each rank sends (n-1)/n of a buffer)."""
        n = self.ctx.world_size
        if n == 1 or self.module is None:
            return
        elem = self.ctx.dtype.itemsize if hasattr(self.ctx.dtype, "itemsize") else 4
        params = sum(getattr(p, "ds_numel", p.numel()) for p in self.module.parameters()) * elem
        grads = sum(getattr(p, "ds_numel", p.numel()) for p in self.trainable_parameters()) * elem
        f = (n - 1) / n
        forwards = getattr(self, "_forwards", 0)
        if self.options.stage == 1:
            sent = 2 * f * grads + f * params  # all-reduce gradients, all-gather updated params
        elif self.options.stage == 2:
            sent = f * grads + f * params  # reduce-scatter gradients, all-gather updated params
        else:  # gather params in every forward and again in backward, reduce-scatter gradients
            sent = 2 * forwards * f * params + f * grads
        self.ctx.comm.add(f"zero{self.options.stage}_analytic", int(sent))
        self._forwards = 0

    def _backward(self, seed: torch.Tensor) -> None:
        if self.engine is None:
            seed.backward()
            return
        # Reduction at the boundary happens once, in reduce_gradients().
        self.engine.set_gradient_accumulation_boundary(False)
        self.engine.backward(seed * self._seed_scale if self._seed_scale != 1.0 else seed)

    def encode(self, mb: int, inputs: list[dict[str, torch.Tensor]]) -> list[EmbeddingShard]:
        assert isinstance(self.family, EncoderFamily)
        family = self.family
        values = self._forward(lambda m: [family.encode(m, x) for x in inputs])
        return [EmbeddingShard.whole(v) for v in values]

    def backward(self, mb: int, outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and o.numel()]
        if not pairs:
            if self.engine is not None and self.options.stage >= 2:
                raise RuntimeError(
                    f"ZeRO stage {self.options.stage} reduces gradients inside backward, so every rank of "
                    f"group {self.ctx.module!r} needs gradients every microbatch; "
                    f"rank {self.ctx.rank} got none"
                )
            return
        # <out, grad> has exactly ``grad`` as its gradient w.r.t. ``out``: the
        # external gradient enters the engine's backward as a scalar seed.
        seed = sum((o * g.to(o.dtype)).sum() for o, g in pairs)
        self._backward(seed)  # type: ignore[arg-type]

    def llm_forward(
        self, inputs: list[dict[str, torch.Tensor]], embeds: list[dict[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(self.family, LanguageFamily)
        family = self.family
        return self._forward(lambda m: family.forward(m, inputs, embeds))

    def loss_and_backward(
        self,
        mb: int,
        inputs: list[dict[str, torch.Tensor]],
        embeds: list[dict[str, torch.Tensor]],
        loss_scale: float,
    ) -> float:
        logits, labels = self.llm_forward(inputs, embeds)
        loss_sum = self.loss_sum(logits, labels)
        self._backward(loss_sum * loss_scale)
        if self._seed_scale != 1.0:
            # The seed scale is for DeepSpeed's averaging of parameter
            # gradients only; input gradients go back to the encoders unscaled.
            for e in embeds:
                for t in e.values():
                    if t.grad is not None:
                        t.grad.div_(self._seed_scale)
        return float(loss_sum.detach())

    # -- after backward ---------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        if self.engine is None or self.optimizer is None:
            return
        self.engine.set_gradient_accumulation_boundary(True)
        if self.options.stage >= 2:
            # Reduced in backward already; only the boundary bookkeeping is left
            # (DeepSpeed's own entry point for caller-owned accumulation).
            self.engine.optimizer.finalize_gradient_accumulation_boundary()
        else:
            self.engine.allreduce_gradients()

    def grad_norm_sq(self) -> float:
        if self.engine is None or self.optimizer is None:
            return 0.0
        return runtime.global_grad_norm(self.engine.optimizer, self.options.stage) ** 2

    def step(self, clip_coef: float) -> None:
        if self.engine is None or self.optimizer is None:
            return
        self.optimizer.clip_coef = float(clip_coef)  # type: ignore[attr-defined]
        self._count_comm()
        self.engine.step()  # the engine also steps the scheduler
        self.optimizer.clip_coef = 1.0  # type: ignore[attr-defined]

    def zero_grad(self) -> None:
        if self.engine is not None and self.optimizer is not None:
            self.engine.optimizer.zero_grad(set_to_none=True)

    # -- state ------------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        with runtime.gathered(self.module, self.options.stage, self.engine is not None):
            return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        if self.engine is None or self.optimizer is None:
            return {}
        from deepspeed.utils import safe_get_full_grad

        out = {}
        for name, p in self.module.named_parameters():
            if p.requires_grad:  # collective: every rank, same order
                g = safe_get_full_grad(p)
                if g is not None:
                    out[name] = (
                        g.detach().float().cpu().view(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
                    )
        return out

    def save(self, path: Path) -> None:
        """DeepSpeed checkpoint (collective): model states plus every rank's
        optimizer partition and the scheduler, under ``path/zero/``."""
        Path(path).mkdir(parents=True, exist_ok=True)
        if self.engine is None:
            super().save(path)
            return
        self.engine.save_checkpoint(str(path), tag=CHECKPOINT_TAG, save_latest=False)

    def load(self, path: Path) -> None:
        if self.engine is None:
            super().load(path)
            return
        load_path, _ = self.engine.load_checkpoint(
            str(path),
            tag=CHECKPOINT_TAG,
            load_optimizer_states=self.optimizer is not None,
            load_lr_scheduler_states=self.scheduler is not None,
        )
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint (tag {CHECKPOINT_TAG!r}) under {path}")
