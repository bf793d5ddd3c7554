"""Parallel strategies: how one module is split across the ranks of its group.

The contract a strategy plugin states before any actor starts: its name, the
options it accepts, what it can do (degrees, recompute modes, LoRA, precision
recipes), its checks and its cost hook (:class:`StrategySpec`). The rank-side
building blocks (:class:`disagg.kit.Strategy`, the role defaults for a module
every rank holds whole) are in :mod:`disagg.kit`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict, PositiveInt, model_validator
from torch import nn

from disagg.interfaces.context import GroupContext, OptimSpec
from disagg.interfaces.cost import Cost, CostQuery
from disagg.interfaces.family import Family
from disagg.interfaces.shard import EmbeddingShard

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "RankStrategy",
    "RecomputeMode",
    "ReplicatedOptions",
    "StrategyOptions",
    "StrategySpec",
]

#: values of ``parallel.<module>.recompute``
RecomputeMode = Literal["none", "full", "selective"]
#: ``parallel.llm.loss_chunk_tokens``'s default: at Qwen2.5's 152k vocabulary one chunk's fp32
#: logits are 0.62 GB whole (ddp, zero) and 78 MB per rank under 8-way TP, while a 1024-row
#: matmul still fills a GPU
DEFAULT_CHUNK_TOKENS = 1024


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
    loss_chunk_tokens: PositiveInt | None = DEFAULT_CHUNK_TOKENS
    """``parallel.llm.loss_chunk_tokens`` (core's key, the LLM only): the loss applies the
    output head to this many tokens at a time, so one chunk's logits exist at once, in
    forward and backward (:mod:`disagg.kit.chunked_loss`); ``null``: the whole
    microbatch at once (Hugging Face's way: tokens x vocabulary fp32 logits)."""
    offload: Literal["none", "optimizer", "activations", "all"] = "none"
    """``parallel.<module>.offload`` (core's key, every first-party strategy): ``optimizer`` keeps
    the optimizer's state in host memory (pinned on CUDA) between steps: the masters the optimizer
    steps, the step's gradient sums and the AdamW moments; the step runs on the host and only the
    working weights (and each microbatch's gradient until it is copied out) stay on the device
    (:mod:`disagg.kit.offload`; ``zero``: DeepSpeed's ``offload_optimizer``). ``activations`` (only
    with ``recompute: full``) keeps each recomputed block's saved input in host memory between its
    forward and its replay (:mod:`disagg.kit.recompute.offload`); ``all`` is both."""

    mlp_tiles: PositiveInt | Literal["auto"] = 1
    """``parallel.<module>.mlp_tiles`` (core's key, the strategies with ``mlp_tiles_support``): each
    block's MLP over the sequence in this many checkpointed tiles (``auto``: ``ceil(rows /
    hidden)``), one tile's intermediates alive at a time (:mod:`disagg.kit.recompute.tiled_mlp`);
    1: off."""

    @model_validator(mode="after")
    def _activations_need_full_recompute(self) -> StrategyOptions:
        if self.offload in ("activations", "all") and self.recompute != "full":
            raise ValueError(
                f"offload: {self.offload} moves the inputs that recompute: full keeps per block to "
                f"host memory, but recompute is {self.recompute!r}; set recompute: full, or offload: "
                "none or optimizer (allowed with recompute none/selective: none, optimizer)"
            )
        return self


class ReplicatedOptions(StrategyOptions):
    """Options of a strategy whose every rank holds the whole module and sums gradients over the
    group with the default reduction (``ddp``, ``ulysses``)."""

    overlap_grad_reduce: bool = False
    """``parallel.<module>.overlap_grad_reduce``: sum each gradient bucket while the step's last
    backward still runs (as torch DDP does) instead of after it, on a process group of its own
    (:class:`disagg.kit.grads.overlap.OverlappedReducer`). The same sums; it holds every bucket's
    flat buffer until the step's reduction ends (one extra copy of the gradients), which is why it
    is off by default, as in Megatron's ``overlap_grad_reduce``."""
    shard: Literal["none", "optimizer", "gradients", "parameters"] = "none"
    """``parallel.<module>.shard``: the module's state split over all ``degree x replicas`` ranks
    of its group, ZeRO-1/2/3 (:mod:`disagg.kit.sharding`): ``optimizer`` the AdamW state
    (torch ``ZeroRedundancyOptimizer``), ``gradients`` also the gradients and ``parameters``
    also the parameters (torch FSDP2 per block; ``gradients`` keeps a microbatch's gathered
    parameters from its forward to its backward). Beyond ``optimizer``: image encoders and the
    LLM; not with ``overlap_grad_reduce``."""

    @model_validator(mode="after")
    def _offload_without_overlap(self) -> ReplicatedOptions:
        if self.offload in ("optimizer", "all") and self.overlap_grad_reduce:
            raise ValueError(
                "offload: optimizer cannot be combined with overlap_grad_reduce: true (its buckets "
                "would sum device gradients already copied to the host); set overlap_grad_reduce: "
                "false or offload: none"
            )
        return self


class StrategySpec:
    """What a strategy states at class level, before any actor starts: read by config
    validation, ``disagg plan`` and ``disagg bench``. :class:`disagg.kit.Strategy` adds the
    rank-side defaults; a strategy subclasses that."""

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
    #: the largest ``parallel.<module>.degree`` it runs (``None``: any; the
    #: strategy's :meth:`check` decides). Data parallelism without sharding
    #: (``ddp``) sets 1, and the default :meth:`check` then refuses other degrees
    max_degree: ClassVar[int | None] = None
    options_model: ClassVar[type[StrategyOptions]] = StrategyOptions
    #: values of ``parallel.<module>.recompute`` this strategy applies; others are
    #: refused at validation, naming the module and these
    recompute_modes: ClassVar[tuple[str, ...]] = ("none",)
    #: trains the PEFT LoRA adapters core injects after ``Family.build``
    #: (``train.modules.<m>.lora``, :mod:`disagg.kit.lora`): True on any linear;
    #: a tuple of layer-map kinds (``column``, ``row``, ``output``) names the only
    #: linears its adapters may wrap (a strategy that rewrites linears builds its own
    #: adapters for those); False: refused at validation
    lora_support: ClassVar[bool | tuple[str, ...]] = True
    #: its ``parallelize`` applies ``train.modules.<m>.lora`` itself (``self.lora``, after
    #: rewriting the linears it wraps, from :func:`disagg.kit.lora.draw_adapters`'s draws):
    #: core then injects no PEFT layers into the module it builds
    lora_step: ClassVar[bool] = False
    #: values of ``train.precision`` (:data:`disagg.interfaces.precision.RECIPES`) this strategy
    #: honours; a run whose recipe a module's strategy does not list is refused at validation,
    #: naming the module, the strategy and these
    precisions: ClassVar[tuple[str, ...]] = ("fp32",)
    #: runs ``parallel.<module>.context_parallel`` > 1 (the sequence split over a replica's
    #: ranks, :mod:`disagg.kit.context_parallel`); False: validation refuses a degree > 1
    context_parallel_support: ClassVar[bool] = False
    #: runs ``parallel.<module>.mlp_tiles`` > 1 (:mod:`disagg.kit.recompute.tiled_mlp`: the family's
    #: MLPs over checkpointed row tiles) exactly; False: validation refuses it
    mlp_tiles_support: ClassVar[bool] = False

    # -- validation, before any actor starts -------------------------------------------------
    @classmethod
    def check(cls, family: Family, degree: int, replicas: int, options: StrategyOptions) -> list[str]:
        """Problems with this strategy for ``family`` at this mesh (sentences).
        By default only :attr:`max_degree`."""
        if cls.max_degree is None or degree <= cls.max_degree:
            return []
        if cls.max_degree == 1:
            return [
                f"strategy {cls.name!r} has no sharding: degree must be 1, got {degree}; "
                "use replicas for data parallelism"
            ]
        return [f"strategy {cls.name!r} runs degree {cls.max_degree} at most, got {degree}"]

    @classmethod
    def precision_problems(cls, recipe: str, options: StrategyOptions, where: str) -> list[str]:
        """Problems with ``options`` (``parallel.<module>``, at ``where``) under the
        ``train.precision`` recipe ``recipe``, one of :attr:`precisions` (sentences naming the
        keys). None by default; e.g. ``zero`` refuses an offloaded optimizer under ``bf16``."""
        return []

    # -- planning (``disagg plan``), before any actor starts ------------------------------------
    @classmethod
    def estimate(cls, query: CostQuery, options: StrategyOptions) -> Cost | None:
        """What one rank (the busiest) would hold, send and compute per optimizer
        step for ``query`` (module shape, degree, replicas, sequence length) under
        ``options``. ``None`` (the default) reports nothing: the planner then
        lists the strategy as skipped rather than guessing. A strategy states its
        own formulas, built from :mod:`disagg.kit.cost.rules` (ring and
        all-to-all bytes, the state rule, activations and FLOPs of a whole module)
        and assembled with :func:`disagg.kit.cost.assemble.assemble`."""
        return None

    @classmethod
    def option_variants(cls) -> list[dict[str, Any]]:
        """Option values ``disagg plan`` tries for this strategy, each a dict of
        ``parallel.<module>`` keys (the rest keep their defaults; ``recompute`` is
        searched on top of these from :attr:`recompute_modes`)."""
        return [{}]


@runtime_checkable
class RankStrategy(Protocol):
    """Exactly what core's actor (``disagg.runtime.actor``: the worker, its checkpoint state
    and step accounting) uses of a strategy on its rank, in the order of a step; a test holds
    the actor to it and every first-party strategy to its signatures. :class:`disagg.kit.Strategy`
    implements it for a module every rank holds whole; a strategy built otherwise must too."""

    ctx: GroupContext
    #: this rank's module after :meth:`setup` (the actor reads its train mode and saved bytes)
    module: nn.Module | None
    #: what a checkpoint's schedule state reads and restores
    optimizer: Any
    scheduler: Any

    # -- set-up ------------------------------------------------------------------------------------
    def build_module(self) -> nn.Module: ...
    def setup(self, module: nn.Module, optim: OptimSpec | None) -> None: ...

    # -- encoder role ------------------------------------------------------------------------------
    def encode(self, mb: int, inputs: list[dict[str, torch.Tensor]]) -> list[EmbeddingShard]: ...
    def backward(self, mb: int, outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None: ...
    def release(self, mb: int) -> None: ...

    # -- language-model role -----------------------------------------------------------------------
    def loss_and_backward(
        self,
        mb: int,
        inputs: list[dict[str, torch.Tensor]],
        embeds: list[dict[str, torch.Tensor]],
        loss_scale: float,
    ) -> float: ...
    def evaluate(
        self, inputs: list[dict[str, torch.Tensor]], embeds: list[dict[str, torch.Tensor]]
    ) -> tuple[float, int, int]: ...
    def returns_input_grads(self) -> bool: ...

    # -- after backward ----------------------------------------------------------------------------
    def arm_last_backward(self) -> None: ...
    def reduce_gradients(self) -> None: ...
    def grad_norm_sq(self) -> float: ...
    def step(self, clip_coef: float) -> None: ...
    def zero_grad(self) -> None: ...
    def current_lr(self) -> float: ...
    def state_bytes(self) -> int: ...

    # -- the full form, sharded checkpoints, random streams ----------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]: ...
    def full_grads(self) -> dict[str, torch.Tensor]: ...
    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]: ...
    def load_full_state(
        self, params: dict[str, torch.Tensor], optim_state: dict[str, dict[str, torch.Tensor]]
    ) -> None: ...
    def sharded_state(self, saved: Mapping[str, Any] | None = None) -> Any: ...
    def refresh_weights(self) -> None: ...
    def rng_state(self) -> dict[str, torch.Tensor]: ...
    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None: ...
