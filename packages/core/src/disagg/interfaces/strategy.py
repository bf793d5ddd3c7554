"""Parallel strategies: how one module is split across the ranks of its group."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from disagg.interfaces.context import GroupContext, OptimSpec
from disagg.interfaces.cost import Cost, CostQuery
from disagg.interfaces.family import EncoderFamily, Family, LanguageFamily
from disagg.interfaces.grads import agree_on_grads, all_reduce_bucketed, sum_of_squares
from disagg.interfaces.parts import freeze_parts, optimizer_groups
from disagg.interfaces.recompute import Recompute, RecomputeMode
from disagg.interfaces.shard import EmbeddingShard


class StrategyOptions(BaseModel):
    """Extra keys a strategy accepts in ``parallel.<module>`` (e.g. ``stage``).

    Subclass it and set ``Strategy.options_model``; unknown keys are rejected
    at config time with the allowed ones listed.
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    recompute: RecomputeMode = "none"
    """``parallel.<module>.recompute`` (core's key, passed to every strategy): ``full``
    recomputes every transformer block in backward, ``selective`` the attention core only;
    a strategy lists what it can do in ``Strategy.recompute_modes``."""


class Strategy(ABC):
    """One rank's view of a parallelized module.

    Lifecycle in the actor: ``__init__`` -> ``setup(module, optim)`` -> per step
    (``encode`` & ``backward`` | ``loss_and_backward``)* -> ``reduce_gradients``
    -> ``grad_norm_sq`` -> ``step(clip_coef)`` -> ``zero_grad``.

    Gradient convention: the loss is already divided by the *global* label
    count, so gradients from different replicas and shards are **summed**
    across the group, exactly once per element.

    The defaults below suit strategies that keep a full replica of every
    parameter on every rank (``ddp``, ``ulysses``); others override them.
    """

    #: value of ``parallel.<module>.strategy``
    name: ClassVar[str]
    #: the plugin distribution that provides it (for error messages)
    distribution: ClassVar[str] = "disagg-core"
    #: the strategy cannot run a replica that got no sample in a microbatch
    #: (its ranks' collectives depend on having data): config validation then
    #: requires each microbatch to give every replica at least one sample. The
    #: first-party strategies do not need it (``zero`` makes the same
    #: collectives whatever a rank's share, an empty one included)
    lockstep: ClassVar[bool] = False
    options_model: ClassVar[type[StrategyOptions]] = StrategyOptions
    #: values of ``parallel.<module>.recompute`` this strategy applies; others are
    #: refused at validation, naming the module and these
    recompute_modes: ClassVar[tuple[str, ...]] = ("none",)

    # -- validation, before any actor starts -------------------------------------------------
    @classmethod
    def check(cls, family: Family, degree: int, replicas: int, options: StrategyOptions) -> list[str]:
        """Problems with this strategy for ``family`` at this mesh (sentences)."""
        return []

    # -- life in the actor ----------------------------------------------------------------------
    def __init__(self, ctx: GroupContext, family: Family, options: StrategyOptions) -> None:
        self.ctx = ctx
        self.family = family
        self.options = options
        self.module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        #: this module's ``recompute`` (strategies add their streams and captures)
        self.recompute = Recompute(getattr(options, "recompute", "none"))

    @abstractmethod
    def parallelize(self, module: nn.Module) -> nn.Module:
        """Rewrite/wrap the unpartitioned module for this rank; return it."""

    def setup(self, module: nn.Module, optim: OptimSpec | None) -> None:
        """Parallelize and, unless the module is frozen (``optim is None``),
        create its optimizer and scheduler."""
        self.module = self.parallelize(module.to(self.ctx.device))
        if optim is None:
            self.module.requires_grad_(False)
            return
        self.freeze_parts(optim)
        self.optimizer = self.make_optimizer(optim)
        self.scheduler = make_scheduler(self.optimizer, optim)

    def trainable_parameters(self) -> list[nn.Parameter]:
        assert self.module is not None
        return [p for p in self.module.parameters() if p.requires_grad]

    def freeze_parts(self, optim: OptimSpec) -> None:
        """Apply ``optim.frozen`` (the parts ``train.modules.<m>.freeze`` names)
        to ``self.module``; strategies with their own ``setup`` call it before
        collecting :meth:`trainable_parameters`."""
        assert self.module is not None
        freeze_parts(self.module, dict(optim.frozen), f"train.modules.{self.ctx.module}")

    def param_groups(self, optim: OptimSpec) -> list[dict[str, Any]]:
        """The trainable parameters as optimizer param groups: one per
        ``train.modules.<m>.param_groups`` part (its lr / weight decay), plus
        the rest with the module's settings."""
        assert self.module is not None
        where = f"train.modules.{self.ctx.module}"
        return optimizer_groups(self.module, self.trainable_parameters(), optim.groups, where)

    def make_optimizer(self, optim: OptimSpec) -> torch.optim.Optimizer:
        # CPU: foreach=False keeps the update bit-identical to the per-tensor
        # reference. CUDA: the fused kernel (one launch for all tensors; bf16
        # runs are compared within a tolerance anyway).
        kernel = {"fused": True} if self.ctx.device.type == "cuda" else {"foreach": False}
        return torch.optim.AdamW(
            self.param_groups(optim),
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            betas=optim.betas,
            eps=optim.eps,
            **kernel,
        )

    # -- encoder role -----------------------------------------------------------------------------
    def encode(self, mb: int, inputs: list[dict[str, torch.Tensor]]) -> list[EmbeddingShard]:
        """Forward this rank's share of each sample of microbatch ``mb`` (one
        shard per sample, possibly empty); the graph is kept until
        :meth:`backward` for the same ``mb``. Several microbatches may be in
        flight, and their backwards may come in any order."""
        assert isinstance(self.family, EncoderFamily) and self.module is not None
        return [EmbeddingShard.whole(self.family.encode(self.module, x)) for x in inputs]

    def backward(self, mb: int, outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Backward of microbatch ``mb`` from gradients of this rank's shard values."""
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and o.numel()]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])

    def release(self, mb: int) -> None:
        """Forget what :meth:`encode` kept for ``mb`` when no backward will
        come (evaluation, a frozen module); strategies that keep per-microbatch
        state override it."""
        return None

    # -- llm role ---------------------------------------------------------------------------------
    def loss_and_backward(
        self,
        mb: int,
        inputs: list[dict[str, torch.Tensor]],
        embeds: list[dict[str, torch.Tensor]],
        loss_scale: float,
    ) -> float:
        """Forward + backward of ``sum(token losses) * loss_scale``; return the
        unscaled loss sum of this replica's samples (counted once per replica).
        ``embeds`` are leaves; after this returns, their ``.grad`` must hold the
        complete gradient on the ranks for which :meth:`returns_input_grads` is
        true (TP strategies reduce it across TP ranks first)."""
        if not inputs:  # a replica with no sample in this microbatch
            return 0.0
        logits, labels = self.llm_forward(inputs, embeds)
        loss_sum = self.loss_sum(logits, labels)
        (loss_sum * loss_scale).backward()
        return float(loss_sum.detach())

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")

    def llm_forward(
        self, inputs: list[dict[str, torch.Tensor]], embeds: list[dict[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The family's ``(logits, labels)`` through this strategy's module;
        strategies that wrap the module in an engine override it."""
        assert isinstance(self.family, LanguageFamily) and self.module is not None
        return self.family.forward(self.module, inputs, embeds)

    def correct_predictions(self, logits: torch.Tensor, labels: torch.Tensor) -> int:
        """Label tokens whose argmax prediction is right; strategies whose
        logits are split over the vocabulary override it."""
        mask = labels != -100
        return int((logits.argmax(-1)[mask] == labels[mask]).sum())

    def evaluate(
        self, inputs: list[dict[str, torch.Tensor]], embeds: list[dict[str, torch.Tensor]]
    ) -> tuple[float, int, int]:
        """Forward only (called under ``no_grad``): ``(loss sum, label tokens
        whose argmax prediction is right, label tokens)``."""
        if not inputs:
            return 0.0, 0, 0
        logits, labels = self.llm_forward(inputs, embeds)
        count = int((labels != -100).sum())
        return float(self.loss_sum(logits, labels)), self.correct_predictions(logits, labels), count

    def returns_input_grads(self) -> bool:
        """Whether this rank sends embedding gradients back to the encoders.
        Core routes them from the first shard of each replica only."""
        return self.ctx.shard == 0

    # -- after backward ---------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Sum gradients over every rank of the group (replicas and shards)."""
        if self.ctx.world_size == 1:
            return
        params = self.trainable_parameters()
        present = agree_on_grads(params, self.ctx.comm)
        # flat buckets, as torch DDP's reducer: one call per 25 MiB, not per tensor
        all_reduce_bucketed([p.grad for p, keep in zip(params, present) if keep], self.ctx.comm)

    def grad_norm_sq(self) -> float:
        """Squared L2 norm of the module's full gradient, each element once;
        identical on every rank of the group (fused norms, one host sync)."""
        return float(sum_of_squares([p.grad for p in self.trainable_parameters() if p.grad is not None]))

    def step(self, clip_coef: float) -> None:
        """Scale gradients by ``clip_coef`` (computed from the global norm) and step."""
        if self.optimizer is None:
            return
        if clip_coef < 1.0:
            grads = [p.grad for p in self.trainable_parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, clip_coef)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        """Bytes of parameters + gradients + optimizer state held by this rank."""
        assert self.module is not None
        total = 0
        for p in self.module.parameters():
            total += p.numel() * p.element_size()
            if p.grad is not None:
                total += p.grad.numel() * p.grad.element_size()
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                total += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        return total

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else 0.0

    # -- state --------------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Merged, unpartitioned parameters named as in ``family.build()``'s
        module. Collective: call on every rank; rank 0's result is complete."""
        assert self.module is not None
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Merged gradients (after :meth:`reduce_gradients`), named like
        :meth:`full_state_dict`; collective like it."""
        assert self.module is not None
        return {
            n: p.grad.detach().cpu().clone() for n, p in self.module.named_parameters() if p.grad is not None
        }

    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer state of every parameter that has some, merged like
        :meth:`full_state_dict` and under the same names:
        ``{name: {"exp_avg", "exp_avg_sq", "step"}}`` (AdamW). Parameters
        without state (never stepped) are left out. Collective; rank 0's
        result is complete. This layout-free form is what checkpoints hold,
        so any layout can resume from any other's."""
        if self.optimizer is None:
            return {}
        assert self.module is not None
        out = {}
        for name, p in self.module.named_parameters():
            st = self.optimizer.state.get(p)
            if st:
                out[name] = {k: v.detach().cpu().clone() for k, v in st.items() if torch.is_tensor(v)}
        return out

    def load_full_state(
        self, params: dict[str, torch.Tensor], optim_state: dict[str, dict[str, torch.Tensor]]
    ) -> None:
        """Take this rank's part of full parameters and optimizer state (the
        forms of :meth:`full_state_dict` and :meth:`full_optimizer_state`,
        possibly saved under another layout). Collective; every rank gets the
        full tensors."""
        assert self.module is not None
        with torch.no_grad():
            for name, t in self.module.state_dict(keep_vars=True).items():
                if name not in params:
                    raise KeyError(f"checkpoint has no tensor {name!r} for module {self.ctx.module!r}")
                t.copy_(params[name].to(t.device, t.dtype))
        if self.optimizer is None:
            return
        for name, p in self.module.named_parameters():
            if name in optim_state:
                self.optimizer.state[p] = {
                    # torch AdamW keeps its (non-capturable) step count on the CPU
                    k: v.clone() if k == "step" else v.to(p.device, p.dtype).clone()
                    for k, v in optim_state[name].items()
                }

    def rng_state(self) -> dict[str, torch.Tensor]:
        """Random streams of this rank's own beyond torch's default generators
        (core saves those), e.g. a per-shard dropout stream."""
        return {}

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`rng_state` returned (same layout only)."""
        return None

    # -- planning (``disagg plan``), before any actor starts ------------------------------------
    @classmethod
    def estimate(cls, query: CostQuery, options: StrategyOptions) -> Cost | None:
        """What one rank (the busiest) would hold, send and compute per optimizer
        step for ``query`` (module shape, degree, replicas, sequence length) under
        ``options``. ``None`` (the default) reports nothing: the planner then
        lists the strategy as skipped rather than guessing. A strategy states its
        own formulas, built from :mod:`disagg.interfaces.cost_rules` (ring and
        all-to-all bytes, the state rule, activations and FLOPs of a whole module)
        and assembled with :func:`disagg.interfaces.cost.assemble`."""
        return None

    @classmethod
    def option_variants(cls) -> list[dict[str, Any]]:
        """Option values ``disagg plan`` tries for this strategy, each a dict of
        ``parallel.<module>`` keys (the rest keep their defaults; ``recompute`` is
        searched on top of these from :attr:`recompute_modes`)."""
        return [{}]


def make_scheduler(optimizer: torch.optim.Optimizer, optim: OptimSpec) -> Any:
    """A ``transformers.get_scheduler`` schedule stepped once per optimizer step."""
    from transformers import get_scheduler

    return get_scheduler(
        optim.scheduler,
        optimizer=optimizer,
        num_warmup_steps=optim.warmup_steps,
        num_training_steps=max(optim.total_steps, 1),
    )


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` would apply."""
    if not max_norm or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
