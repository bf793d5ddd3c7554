"""``zero``: DeepSpeed ZeRO stages 1, 2 and 3 for any module (degree 1, replicas = ranks).

Every rank of a group makes the same collectives in the same order whatever
its share of a microbatch (any split, including none), by construction:

* ZeRO-3 parameters are gathered **per layer** by DeepSpeed's own hooks, with its
  prefetch, live-parameter and reuse limits (:mod:`disagg_zero.perlayer`), and gradients are
  reduce-scattered by its hooks during the one backward of each call. Those hooks are
  collectives in the order of the submodule calls, which follow the data; so the ranks agree
  on their calls first (:mod:`disagg.kit.lockstep`: the encoder votes before each root call,
  the LLM on its sample and loss-chunk counts) and the short ones make placeholder calls whose
  gradient is exactly zero. Only ``full_state_dict``, ``load_full_state`` and the full
  gradients gather the whole module (``GatheredParameters``).
* Stage 3 builds the module partitioned (:meth:`ZeroStrategy.build_module`,
  :mod:`disagg_zero.build`): no rank ever holds the whole module at set-up.
* Stages 1-2: parameter gradients are computed locally with ``torch.autograd.grad`` and
  handed to DeepSpeed (:meth:`ZeroStrategy.backprop`) through one engine backward whose graph
  is the same on every rank (:mod:`disagg_zero.inject`), so stage 2's reduction hooks fire
  for the same parameters in the same order everywhere; a rank with no samples hands zeros.
* Which parameters really got a gradient is recorded per rank (``autograd.grad``
  returns ``None`` for the others; stage 3: a tensor hook per parameter) and agreed
  across the group with one small all-reduce in :meth:`ZeroStrategy.reduce_gradients`; the optimizer
  (:class:`disagg_zero.optim.MaskedAdamW`) leaves the rest alone, as torch
  AdamW leaves a ``grad=None`` parameter. A step with no gradient anywhere
  skips the engine step and only advances the scheduler.
* Every backward is a non-boundary micro-step; :meth:`ZeroStrategy.reduce_gradients`
  marks the boundary once per optimizer step. The group's norm comes from
  DeepSpeed's partitioned fp32 gradients and the driver's clip coefficient is
  applied by the optimizer, since DeepSpeed's own clipping is off.
* ``train.precision`` runs in DeepSpeed's own mode for the recipe
  (:data:`disagg_zero.dsconfig.PRECISION_SECTIONS`): DeepSpeed casts the module and keeps the
  masters, so core's :class:`~disagg.kit.masters.MasterWeights` stays off; under
  ``bf16`` the masters start from the loaded fp32 weights and are the full form.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from disagg.interfaces import EmbeddingShard, Family, OptimSpec
from disagg.kit import Strategy
from disagg.kit.lockstep import Lockstep
from disagg.kit.masters import cast_floating
from disagg.kit.roles.state import Pieces
from disagg_zero import runtime
from disagg_zero.build import build_partitioned
from disagg_zero.comm import counted
from disagg_zero.dsconfig import (
    backward_scale,
    build_ds_config,
    gather_settings,
    persistence_threshold,
    recipe_problems,
    reduce_bucket_elements,
    zero_section_problems,
)
from disagg_zero.fullstate import ZeroFullState
from disagg_zero.inject import injector, local_grads
from disagg_zero.layout import ZeroLayout
from disagg_zero.optim import masked_adamw
from disagg_zero.options import ZeroOptions
from disagg_zero.perlayer import PerLayerCalls


class ZeroStrategy(Strategy):
    """Data parallelism with ZeRO-partitioned optimizer states (1), gradients (2)
    and parameters (3), through ``deepspeed.initialize``.

    What it changes from the kit's defaults (:class:`disagg.kit.Strategy`), in this order below:

    - set-up: stage 3 builds partitioned (``build_module``); ``parallelize`` is the ordered steps
      recompute -> DeepSpeed (which applies the precision recipe), and ``finish_setup`` hands
      module, optimizer and schedule to ``deepspeed.initialize`` (the engine needs the optimizer,
      which the kit makes after ``parallelize``); the optimizer is :func:`masked_adamw`;
    - the roles' calls at stage 3 (``encode``, ``loss_and_backward``, ``evaluate``): per layer,
      in lockstep, by the :class:`~disagg_zero.perlayer.PerLayerCalls` component (``zero3``);
      stages 1-2 run the kit's;
    - the two hooks: ``module_call`` counts DeepSpeed's collectives; ``backprop`` hands the
      gradients to the engine;
    - the step: ``reduce_gradients``, ``grad_norm_sq``, ``step``, ``zero_grad`` through the
      engine; ``state_bytes`` from DeepSpeed's partitions;
    - the state: the full form and the sharded checkpoint's pieces in DeepSpeed's partitions, by
      the :class:`~disagg_zero.fullstate.ZeroFullState` (``full``) and
      :class:`~disagg_zero.layout.ZeroLayout` (``layout``) components (the kit's defaults
      without an engine);
    - class level: ``check``, ``precision_problems``, ``estimate``, ``option_variants``.
    """

    name: ClassVar[str] = "zero"
    distribution: ClassVar[str] = "disagg-zero"
    options_model: ClassVar[type[ZeroOptions]] = ZeroOptions  # type: ignore[assignment]
    #: AdamW over this rank's fragments of DeepSpeed's partitions (see optim.py)
    build_optimizer = staticmethod(masked_adamw)  # type: ignore[assignment]
    # (the spec's ``lockstep`` stays False: every rank is called for every microbatch, as core
    # does for every strategy, but a rank may get no sample: it joins with zeros)
    recompute_modes: ClassVar[tuple[str, ...]] = ("none", "full")
    #: in DeepSpeed's own mode for each (:data:`disagg_zero.dsconfig.PRECISION_SECTIONS`);
    #: :meth:`precision_problems` refuses the (option, recipe) pairs it cannot do exactly
    precisions: ClassVar[tuple[str, ...]] = ("fp32", "bf16", "bf16-pure")

    @classmethod
    def check(cls, family: Family, degree: int, replicas: int, options: ZeroOptions) -> list[str]:  # type: ignore[override]
        problems = []
        if degree != 1:
            problems.append(
                f"strategy 'zero' shards state across replicas, not samples: degree must be 1, got {degree}; "
                f"use replicas={degree * replicas} for the same number of ranks"
            )
        return problems + zero_section_problems(options)

    @classmethod
    def precision_problems(cls, recipe: str, options: ZeroOptions, where: str) -> list[str]:
        """What of ``options`` (``parallel.<module>`` at ``where``) cannot run under the
        ``train.precision`` recipe ``recipe`` exactly (config time)."""
        return recipe_problems(recipe, options, where)

    def __init__(self, ctx: Any, family: Family, options: ZeroOptions) -> None:  # type: ignore[override]
        super().__init__(ctx, family, options)
        self.options: ZeroOptions = options
        self.engine: Any = None
        self._seed_scale = backward_scale(options, ctx.world_size)
        self._params: list[nn.Parameter] = []
        self._got: list[bool] = []  # per trainable parameter: a gradient on this rank this step
        self._present: list[bool] | None = None  # ... on some rank (after reduce_gradients)
        self._backwards = 0
        #: the placeholder calls of stage 3's lockstep; its image in fp32 (DeepSpeed casts the
        #: module's inputs itself)
        self.lockstep = Lockstep(family)
        #: the roles' calls at stage 3, once the engine exists (finish_setup)
        self.zero3: PerLayerCalls | None = None
        #: the state in DeepSpeed's partitions: the full form and the sharded checkpoint's pieces
        self.full = ZeroFullState(self)
        self.layout = ZeroLayout(self.full)

    # -- setup ------------------------------------------------------------------------------------
    def build_module(self) -> nn.Module:
        """Stage 3: built partitioned, each rank reading only its own slice of every
        weight (:mod:`disagg_zero.build`); stages 1-2 keep whole parameters anyway."""
        if self.options.stage < 3:
            return super().build_module()
        runtime.prepare(self.ctx)
        config = build_ds_config(self.options, self._precision)
        return build_partitioned(lambda: self.family.build(torch.float32), config)

    @property
    def _precision(self) -> str:
        return self.ctx.recipe.name if self.ctx.recipe is not None else "fp32"

    def parallelize(self, module: nn.Module) -> nn.Module:
        """Ordered steps: recompute -> DeepSpeed. LoRA's adapters are in the module already (core
        injects them before ``parallelize``); DeepSpeed partitions them like any parameter."""
        self.apply_recompute(module)
        return self.apply_deepspeed(module)

    def apply_recompute(self, module: nn.Module) -> None:
        """Core's recompute (``activation_checkpointing: true`` is its deprecated spelling): under
        ZeRO-3 the replay's forward gathers each submodule again through DeepSpeed's hooks."""
        self.recompute.apply_full(module, f"family {self.family.name!r} module")

    def apply_deepspeed(self, module: nn.Module) -> nn.Module:
        """DeepSpeed applies the recipe (its bf16 mode: bf16 weights, its own master partitions;
        core's MasterWeights would be a second master copy beside DeepSpeed's); its engine wraps
        module and optimizer in :meth:`finish_setup`, once the optimizer exists."""
        runtime.prepare(self.ctx)
        self.precision_applied = True
        return module

    def finish_setup(self, optim: OptimSpec | None) -> None:
        import deepspeed

        config = build_ds_config(self.options, self._precision)
        recipe = self.ctx.recipe
        if optim is None and self.options.stage < 3:
            # nothing to shard without optimizer states or gradients; the weights in the
            # recipe's dtype all the same (stage 3 is built in it)
            if recipe is not None:
                cast_floating(self.module, recipe.weights)
            return
        self._params = self.trainable_parameters()
        self._got = [False] * len(self._params)
        # DeepSpeed starts its fp32 masters from the bf16 weights it casts; the recipe's start
        # from the loaded fp32 values (stages 1-2: the module's own, stage 3: build.py's)
        seeds = runtime.master_seeds(self._params, self.options.stage) if recipe and recipe.master else None
        where = f"parallel.{self.ctx.module}"
        with runtime.config_errors(where):
            self.engine, *_ = deepspeed.initialize(
                model=self.module,
                optimizer=self.optimizer,
                lr_scheduler=self.scheduler,
                config=config,
                dist_init_required=False,
            )
        if seeds is not None and self.optimizer is not None:
            runtime.seed_masters(self.engine.optimizer, self._params, self.options.stage, seeds)
        del seeds
        for p in self.module.parameters():  # frozen ones' too (build.py keeps every partition's)
            if hasattr(p, "fp32_partition"):
                del p.fp32_partition
        if self.options.stage == 3:
            self.zero3 = PerLayerCalls(self)
        if self.optimizer is not None:
            self.optimizer.set_fragments(  # type: ignore[attr-defined]
                runtime.local_fragments(self.engine.optimizer, self._params, self.options.stage)
            )

    @contextlib.contextmanager
    def module_call(self) -> Iterator[None]:
        """DeepSpeed's collectives inside one call counted; ZeRO-3 gathers per submodule in
        its own hooks (:mod:`disagg_zero.perlayer`), nothing is gathered here."""
        assert self.module is not None
        with counted(self.ctx.comm):
            yield

    def state_bytes(self) -> int:
        """What this rank holds, read from the tensors themselves: torch's view
        of a ZeRO module misses DeepSpeed's partitions and copies."""
        assert self.module is not None
        return runtime.held_bytes(self.module, getattr(self.engine, "optimizer", None), self.optimizer)

    def _hand_to_engine(self, local: list[torch.Tensor | None]) -> None:
        """Record which parameters got a gradient; hand them to DeepSpeed (see
        :mod:`disagg_zero.inject`); the boundary comes in reduce_gradients()."""
        if self.engine is None or self.optimizer is None:
            return
        for i, g in enumerate(local):
            self._got[i] = self._got[i] or g is not None
        # What engine.forward() does first (the strategy never calls it): start
        # a new micro-step, so ZeRO-3 accumulates into, rather than
        # overwrites, the previous micro-step's gradient partitions.
        clear = getattr(self.engine.optimizer, "clear_backward_seen_flag", None)
        if clear is not None:
            clear()
        # ... and what the backward hook engine.forward() registers runs before each backward:
        # the optimizer's prologue. BF16_Optimizer (stage 1 under bf16) adds the module's whole
        # bf16 .grad into its fp32 gradients after every backward and zeroes that .grad only
        # here; without it the 2nd microbatch adds the 1st's gradient again (g1 + (g1 + g2)).
        # (every DeepSpeed ZeRO optimizer has one; pinned in tests/test_deepspeed_private.py)
        self.engine.optimizer.backward_prologue()
        self.engine.set_gradient_accumulation_boundary(False)
        with counted(self.ctx.comm):
            self.engine.backward(injector(self._params, local, self._seed_scale))
        self._backwards += 1

    def backprop(
        self, tensors: list[torch.Tensor], grads: list[torch.Tensor] | None, leaves: list[torch.Tensor]
    ) -> None:
        """Gradients computed locally (``autograd.grad``: ``None`` where a
        parameter is not reached) and handed to DeepSpeed; even with nothing to
        back-propagate, since the gather and the reduction are collectives.
        The LLM's embedding leaves accumulate theirs as ``.grad`` would. ZeRO-3: one
        backward through DeepSpeed's hooks (:meth:`PerLayerCalls.backward`)."""
        if self.zero3 is not None:
            self.zero3.backward(tensors, grads, leaves)
            return
        got = local_grads(tensors, grads, self._params + leaves)
        for t, g in zip(leaves, got[len(self._params) :]):
            if g is not None:
                t.grad = g if t.grad is None else t.grad + g
        self._hand_to_engine(got[: len(self._params)])

    # -- after backward ---------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        if self.engine is None or self.optimizer is None:
            return
        # One small all-reduce: which parameters got a gradient on some rank,
        # and how many backwards each rank ran (they must agree: a mismatch
        # means some rank was not called for some microbatch).
        flags = torch.tensor(self._got + [self._backwards], dtype=torch.int64, device=self.ctx.device)
        self.ctx.comm.all_reduce(flags)
        if int(flags[-1]) != self._backwards * self.ctx.world_size:
            raise RuntimeError(
                f"ZeRO group {self.ctx.module!r}: rank {self.ctx.rank} ran {self._backwards} backward(s) "
                f"this step but the group ran {int(flags[-1])} in total over {self.ctx.world_size} ranks; "
                f"every rank must be called for every microbatch, with or without samples"
            )
        self._present = [bool(v) for v in flags[:-1].tolist()]
        if not self._backwards:
            return  # nothing to reduce: a step in which this group got no sample
        self.engine.set_gradient_accumulation_boundary(True)
        with counted(self.ctx.comm):
            if self.zero3 is not None and not self.zero3.engine_backwards:
                pass  # no pass anywhere in the group this step (the ranks' passes agree)
            elif self.options.stage >= 2:
                # Reduced in backward already; only the boundary bookkeeping is left
                # (DeepSpeed's own entry point for caller-owned accumulation).
                self.engine.optimizer.finalize_gradient_accumulation_boundary()
            else:
                self.engine.allreduce_gradients()

    def _any_grad(self) -> bool:
        return self._present is not None and any(self._present)

    def grad_norm_sq(self) -> float:
        if self.engine is None or self.optimizer is None or not self._any_grad():
            return 0.0
        with counted(self.ctx.comm):
            return runtime.global_grad_norm(self.engine.optimizer, self.options.stage) ** 2

    def step(self, clip_coef: float) -> None:
        if self.engine is None or self.optimizer is None:
            return
        if not self._any_grad():
            # The reference's AdamW skips every grad=None parameter, but its
            # schedule still advances once per optimizer step.
            self.scheduler.step()
            return
        self.optimizer.present = self._present  # type: ignore[attr-defined]
        self.optimizer.clip_coef = float(clip_coef)  # type: ignore[attr-defined]
        with counted(self.ctx.comm):
            self.engine.step()  # the engine also steps the scheduler
        self.optimizer.clip_coef = 1.0  # type: ignore[attr-defined]

    def zero_grad(self) -> None:
        if self.engine is not None and self.optimizer is not None:
            with counted(self.ctx.comm):
                self.engine.optimizer.zero_grad(set_to_none=True)
        self._got = [False] * len(self._params)
        self._present = None
        self._backwards = 0
        if self.zero3 is not None:
            self.zero3.engine_backwards = 0

    # -- the roles' calls: per layer at stage 3 (PerLayerCalls), the kit's otherwise ----------
    def encode(self, mb: int, inputs: list[dict[str, torch.Tensor]]) -> list[EmbeddingShard]:
        return self.zero3.encode(mb, inputs) if self.zero3 is not None else super().encode(mb, inputs)

    def loss_and_backward(
        self,
        mb: int,
        inputs: list[dict[str, torch.Tensor]],
        embeds: list[dict[str, torch.Tensor]],
        loss_scale: float,
    ) -> float:
        if self.zero3 is not None:
            return self.zero3.loss_and_backward(mb, inputs, embeds, loss_scale)
        return super().loss_and_backward(mb, inputs, embeds, loss_scale)

    def evaluate(
        self, inputs: list[dict[str, torch.Tensor]], embeds: list[dict[str, torch.Tensor]]
    ) -> tuple[float, int, int]:
        if self.zero3 is not None:
            return self.zero3.evaluate(inputs, embeds)
        return super().evaluate(inputs, embeds)

    # -- the state in DeepSpeed's partitions (ZeroFullState, ZeroLayout) ---------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.full.state_dict()

    def full_grads(self) -> dict[str, torch.Tensor]:
        return self.full.grads()

    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return self.full.optimizer_state()

    def load_full_state(
        self, params: dict[str, torch.Tensor], optim_state: dict[str, dict[str, torch.Tensor]]
    ) -> None:
        if self.engine is None:  # nothing partitioned (stages 1-2 frozen): whole tensors
            super().load_full_state(params, {})
            return
        self.full.load(params, optim_state)

    def sharded_state(self, saved: Mapping[str, Any] | None = None) -> Pieces | None:
        if self.engine is None:  # nothing partitioned (stages 1-2 frozen): whole tensors
            return self.layout_pieces(saved)
        return self.layout.pieces(saved)

    def refresh_weights(self) -> None:
        self.layout.refresh()
        super().refresh_weights()

    @classmethod
    def estimate(cls, query: Any, options: Any) -> Any:
        """DeepSpeed's holdings and calls for the stage (:mod:`disagg_zero.cost`);
        ``recompute`` (or its deprecated spelling ``activation_checkpointing``)
        recomputes activations; ``offload_optimizer`` moves optimizer state off the GPU."""
        from disagg_zero import cost

        return cost.estimate(
            query,
            options.stage,
            persistence_threshold(options),
            recompute=options.recompute,
            offload_optimizer=bool(options.offload_optimizer),
            chunk=getattr(options, "loss_chunk_tokens", None),
            gather=gather_settings(options),
            reduce_bucket=reduce_bucket_elements(options),
        )

    @classmethod
    def option_variants(cls) -> list[dict[str, Any]]:
        """``disagg plan`` tries each stage, each also with DeepSpeed's ``offload_optimizer``
        (``offload: optimizer``; offered on GPU clusters only)."""
        from disagg_zero import cost

        return [dict(v) for v in cost.OPTION_VARIANTS] + [
            {**v, "offload": "optimizer"} for v in cost.OPTION_VARIANTS
        ]
