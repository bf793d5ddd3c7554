"""The parallelizer role: one rank's module from set-up to optimizer step.

Order in the actor: ``setup`` -> per step (the roles' forwards and backwards,
each inside :meth:`Parallelizer.module_call`)* -> ``reduce_gradients`` ->
``grad_norm_sq`` -> ``step(clip_coef)`` -> ``zero_grad``.

Gradient convention: the loss is already divided by the *global* label count,
so gradients from different replicas and shards are **summed** across the
group, exactly once per element. The defaults keep a whole replica of every
parameter on every rank (``ddp``, ``ulysses``); a strategy that shards
parameters, gradients or optimizer state overrides the reduction, norm and
step, and usually ``module_call``/``backprop``/``finish_setup`` (see ``zero``).

Precision (``train.precision``, ``ctx.recipe``): :meth:`Parallelizer.setup` puts the
parallelized module in the recipe's weights (:func:`~disagg.kit.masters.apply_recipe`);
under ``bf16`` the optimizer is a :class:`~disagg.kit.masters.MasterOptimizer` that steps
the float32 masters and writes the bf16 weights back, and the defaults that reduce, measure,
clip or save run with the parameters seen as their masters (:func:`~disagg.kit.masters.in_master_view`),
so they work on float32 unchanged. An override is called as written: it enters the view
itself where it touches gradients or state.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from disagg.interfaces.context import GroupContext, OptimSpec
from disagg.interfaces.family import Family
from disagg.interfaces.lora import LoraSpec
from disagg.kit.grads import agree_on_grads, all_reduce_bucketed, sum_of_squares
from disagg.kit.grads.overlap import OverlappedReducer
from disagg.kit.lora import freeze_base
from disagg.kit.masters import MasterOptimizer, MasterWeights, apply_recipe, in_master_view
from disagg.kit.offload import apply_offload, offloaded
from disagg.kit.parts import freeze_parts, optimizer_groups
from disagg.kit.roles.optimizer import OptimizerBuilder, make_scheduler
from disagg.kit.sharding import fsdp
from disagg.kit.sharding.modes import FSDP_MODES
from disagg.kit.sharding.optimizer import build_optimizer


class Parallelizer(ABC):
    """Set-up, gradient reduction, norm and step of one rank's module."""

    #: makes the optimizer from the trainable parameter groups (see :mod:`.optimizer`): AdamW,
    #: inside torch's ``ZeroRedundancyOptimizer`` under ``shard: optimizer``
    build_optimizer: ClassVar[OptimizerBuilder] = staticmethod(build_optimizer)  # type: ignore[assignment]

    ctx: GroupContext
    family: Family
    options: Any
    module: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    #: set up when ``overlap_grad_reduce`` is on: sums gradients while the last backward runs
    reducer: OverlappedReducer | None = None
    #: set by a strategy whose ``parallelize`` applied the recipe itself (FSDP2's policy)
    precision_applied: bool = False
    #: the FSDP2 root unit around the module (``shard: gradients | parameters``; :meth:`shard_state`)
    fsdp_root: nn.Module | None = None
    #: FSDP2 keeps the shards and the AdamW state in host memory (``offload: optimizer``)
    offload_policy: bool | None = None
    #: the largest whole-parameter bytes a ``gradients`` forward left gathered (held until backward)
    whole_bytes: int = 0
    #: the module's LoRA spec while :meth:`setup` runs (None: no adapters); a strategy with
    #: ``lora_step`` applies it in its ``parallelize``
    lora: LoraSpec | None = None

    @property
    def master_weights(self) -> MasterWeights | None:
        """The float32 masters under ``train.precision: bf16``, which the optimizer owns, or the
        host masters under ``offload: optimizer`` (None otherwise, and for a frozen module)."""
        opt = self.optimizer
        return opt.masters if isinstance(opt, MasterOptimizer) else None

    def build_module(self) -> nn.Module:
        """This rank's module before :meth:`setup`, in fp32 (master weights): the family's
        unpartitioned build by default; a strategy that partitions at construction
        (``zero`` stage 3) builds it so that no rank holds the whole module, or returns
        ``family.build_empty`` (meta device, ``megatron_tp``) and loads its own part in
        :meth:`parallelize`."""
        return self.family.build(torch.float32)

    @abstractmethod
    def parallelize(self, module: nn.Module) -> nn.Module:
        """Rewrite/wrap the unpartitioned module (already on this rank's
        device, unless :meth:`build_module` built it empty) for this rank; return it."""

    def setup(self, module: nn.Module, optim: OptimSpec | None) -> None:
        """Parallelize and, unless the module is frozen (``optim is None``),
        create its optimizer and scheduler; then :meth:`finish_setup`."""
        if not any(p.is_meta for p in module.parameters()):
            module = module.to(self.ctx.device)
        # else built empty (build_module): its parallelize allocates and loads its own part
        self.lora = optim.lora if optim is not None else None
        self.module = self.parallelize(module)
        if optim is None:
            self.module.requires_grad_(False)
        else:
            if optim.lora is not None:  # the base stays frozen whatever layers replaced it
                freeze_base(self.module, optim.lora)
            self.freeze_parts(optim)
        recipe = self.ctx.recipe
        masters = None
        if offloaded(self.options) and optim is not None and not self.precision_applied:
            masters = apply_offload(self.module, recipe)  # masters, gradient sums, AdamW on the host
        elif recipe is not None and not self.precision_applied:
            masters = apply_recipe(self.module, recipe)
        if optim is not None:
            # AdamW and ZeRO-1 are built over the float32 masters, which they step
            with masters.view() if masters is not None else contextlib.nullcontext():
                inner = type(self).build_optimizer(self.param_groups(optim), optim, self.ctx, self.options)
            self.scheduler = make_scheduler(inner, optim)
            self.optimizer = MasterOptimizer(inner, masters) if masters is not None else inner
            if getattr(self.options, "overlap_grad_reduce", False) and self.ctx.world_size > 1:
                if self.master_weights is not None:  # validation refuses it (precision_problems)
                    raise ValueError(
                        f"parallel.{self.ctx.module}.overlap_grad_reduce cannot be combined with "
                        "train.precision: bf16 or offload: optimizer (its buckets would sum the "
                        "working gradients, not the master ones)"
                    )
                # every rank of the group builds it (a new process group is collective)
                self.reducer = OverlappedReducer(
                    self.trainable_parameters(), self.ctx.comm, timeout=self.ctx.collective_timeout
                )
        self.finish_setup(optim)

    def finish_setup(self, optim: OptimSpec | None) -> None:
        """After the optimizer exists (none when frozen): e.g. wrap module and
        optimizer in an engine. Nothing by default."""
        return None

    def masters(self, write: bool = False) -> contextlib.AbstractContextManager[None]:
        """The parameters seen as their float32 masters (``bf16``); nothing under other recipes.
        ``write``: the call writes the masters (the bf16 weights are refreshed afterwards)."""
        mw = self.master_weights
        return mw.view(write) if mw is not None else contextlib.nullcontext()

    def refresh_weights(self) -> None:
        """After a checkpoint's reader filled the masters in place: copy them into the weights."""
        if self.master_weights is not None:
            self.master_weights.refresh()

    def trainable_parameters(self) -> list[nn.Parameter]:
        assert self.module is not None
        return [p for p in self.module.parameters() if p.requires_grad]

    def freeze_parts(self, optim: OptimSpec) -> None:
        """Apply ``optim.frozen`` (the parts ``train.modules.<m>.freeze`` names)
        to ``self.module`` before the trainable parameters are collected."""
        assert self.module is not None
        freeze_parts(self.module, dict(optim.frozen), f"train.modules.{self.ctx.module}")

    def param_groups(self, optim: OptimSpec) -> list[dict[str, Any]]:
        """The trainable parameters as optimizer param groups: one per
        ``train.modules.<m>.param_groups`` part (its lr / weight decay), plus
        the rest with the module's settings."""
        assert self.module is not None
        where = f"train.modules.{self.ctx.module}"
        return optimizer_groups(self.module, self.trainable_parameters(), optim.groups, where)

    # -- parallel.<module>.shard: the state sharded over the group (disagg.kit.sharding) ---------
    @property
    def shard_mode(self) -> str:
        return getattr(self.options, "shard", "none")

    @property
    def fsdp(self) -> bool:
        """Parameters and gradients are FSDP2 shards (``gradients``/``parameters`` over >1 rank)."""
        return self.shard_mode in FSDP_MODES and self.ctx.world_size > 1

    def shard_state(self, module: nn.Module) -> nn.Module:
        """The last step of a ``parallelize`` whose ranks hold the whole module otherwise: FSDP2
        units under ``gradients``/``parameters`` (``optimizer``: :attr:`build_optimizer`'s
        ZeRO-1). The reduction, norm, step and full form below work on shards and whole
        tensors alike, and :meth:`encode` keeps the group's gathers in lockstep."""
        if self.fsdp:
            # FSDP2 applies train.precision itself: its policy casts the fp32 shards (bf16), or
            # the shards are bf16 (bf16-pure)
            offload = offloaded(self.options)
            self.fsdp_root = fsdp.shard_module(module, self.ctx, self.shard_mode, offload)
            self.offload_policy = offload or None
            self.precision_applied = True
        return module

    def sharded_call(self, fn: Any, *args: Any) -> Any:
        """``fn(module, *args)`` under the FSDP2 root unit; then what ``gradients`` keeps gathered."""
        assert self.fsdp_root is not None and self.module is not None
        out = fsdp.call(self.fsdp_root, fn, *args)
        if self.shard_mode == "gradients":
            self.whole_bytes = max(self.whole_bytes, fsdp.whole_param_bytes(self.module))
            if not torch.is_grad_enabled():  # no backward will reshard what the forward gathered
                fsdp.reshard(self.fsdp_root)
        return out

    # -- the two hooks every forward and backward goes through ---------------------------------
    @contextlib.contextmanager
    def module_call(self) -> Iterator[None]:
        """Around each forward and each backward of the module (``encode``,
        ``backward``, ``loss_and_backward``, ``evaluate``, ``full_state_dict``),
        called on every rank whatever its share of the samples (none included):
        where a strategy that shards parameters gathers them. Nothing by default."""
        yield

    def backprop(
        self,
        tensors: list[torch.Tensor],
        grads: list[torch.Tensor] | None,
        leaves: list[torch.Tensor],
    ) -> None:
        """Backward of ``tensors`` seeded with ``grads`` (``None``: scalars,
        seeded with 1): parameter gradients accumulate into ``.grad``, and so do
        those of ``leaves`` (the LLM's embedding inputs). Called inside
        :meth:`module_call`, on every rank, with empty ``tensors`` when the rank
        has nothing to back-propagate."""
        if tensors:
            torch.autograd.backward(tensors, grads)

    def arm_last_backward(self) -> None:
        """The next backward is this rank's last of the step (the driver says so, from the
        schedule): with ``overlap_grad_reduce``, buckets are summed from then on as they fill."""
        if self.reducer is not None:
            self.reducer.arm()

    # -- after backward ---------------------------------------------------------------------------
    @in_master_view()
    def reduce_gradients(self) -> None:
        """Sum gradients over every rank of the group (replicas and shards); FSDP2 summed them
        (reduce-scatter) in backward already."""
        if self.ctx.world_size == 1 or self.fsdp:
            return
        if self.reducer is not None:
            self.reducer.finish()
            return
        params = self.trainable_parameters()
        present = agree_on_grads(params, self.ctx.comm)
        # flat buckets, as torch DDP's reducer: one call per 25 MiB, not per tensor
        all_reduce_bucketed([p.grad for p, keep in zip(params, present) if keep], self.ctx.comm)

    @in_master_view()
    def grad_norm_sq(self) -> float:
        """Squared L2 norm of the module's full gradient, each element once;
        identical on every rank of the group (fused norms, one host sync; FSDP2 shards
        summed over the group, their padding left out)."""
        total = sum_of_squares(
            [fsdp.local(p.grad) for p in self.trainable_parameters() if p.grad is not None]
        )
        if self.fsdp:
            total = total.to(self.ctx.device).reshape(1)
            self.ctx.comm.all_reduce(total)
        return float(total)

    def step(self, clip_coef: float) -> None:
        """Scale gradients by ``clip_coef`` (computed from the global norm) and step."""
        if self.optimizer is None:
            return
        if clip_coef < 1.0:
            with self.masters():
                grads = [fsdp.local(p.grad) for p in self.trainable_parameters() if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, clip_coef)
        self.optimizer.step()  # under bf16: the masters', then the weights written back
        if self.scheduler is not None:
            self.scheduler.step()

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    # -- what the step's record reads -----------------------------------------------------------
    @in_master_view()
    def state_bytes(self) -> int:
        """Bytes of parameters + gradients + optimizer state held by this rank, from the
        tensors: shards under FSDP2 (plus the whole parameters a ``gradients`` step holds from
        forward to backward), this rank's partition of the AdamW state under ZeRO-1."""
        assert self.module is not None
        total = 0
        for p in self.module.parameters():
            total += fsdp.local(p).numel() * p.element_size()
            if p.grad is not None:
                total += fsdp.local(p.grad).numel() * p.grad.element_size()
        opt = self.optimizer
        if opt is not None and self.shard_mode == "optimizer" and self.ctx.world_size > 1:
            opt = opt.optim  # ZeroRedundancyOptimizer: its local AdamW holds this rank's partition
        if opt is not None:
            for st in opt.state.values():
                total += sum(
                    fsdp.local(v).numel() * v.element_size() for v in st.values() if torch.is_tensor(v)
                )
        return total + self.whole_bytes + self.precision_bytes()

    def precision_bytes(self) -> int:
        """State the recipe adds beyond parameters, gradients and optimizer state as seen in the
        master view: the bf16 weights of the trainable parameters under ``bf16``."""
        return self.master_weights.weight_bytes() if self.master_weights is not None else 0

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else 0.0
