"""One rank of any strategy, set up and stepped as core's worker does: the test kit's
only calls into a :class:`~disagg.kit.Strategy`.

Plugin tests run a strategy on gloo ranks (:func:`disagg.testing.dist.run_ranks`)
and compare it with the single-process reference. They build the rank here
(:func:`strategy_rank`) and drive it through the functions below, never by
calling strategy methods themselves, so that a change of the strategy contract
costs one edit in this file rather than one per harness.
"""

from __future__ import annotations

import io
import math
from typing import Any

import torch
from torch import nn

from disagg.interfaces import EmbeddingShard, Family, GroupContext, OptimSpec, StrategyOptions
from disagg.interfaces.context import dropout_seed
from disagg.interfaces.precision import RECIPES
from disagg.kit import Strategy
from disagg.kit.masters import cast_inputs
from disagg.kit.strategy import clip_coefficient

#: what the harnesses train with unless they say otherwise
DEFAULT_OPTIM = OptimSpec(lr=1e-3)


def rank_context(
    module: str,
    rank: int,
    degree: int,
    replicas: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    precision: str | None = None,
) -> GroupContext:
    """The :class:`GroupContext` core gives rank ``rank`` of a ``degree x replicas`` group;
    ``precision``: a ``train.precision`` recipe (its compute dtype replaces ``dtype``)."""
    recipe = RECIPES[precision] if precision is not None else None
    if recipe is not None:
        dtype = recipe.weights
    return GroupContext(
        module=module,
        rank=rank,
        world_size=degree * replicas,
        degree=degree,
        replicas=replicas,
        device=device or torch.device("cpu"),
        dtype=dtype,
        seed=seed,
        recipe=recipe,
    )


def strategy_rank(
    strategy: type[Strategy],
    family: Family,
    ctx: GroupContext,
    *,
    options: StrategyOptions | dict[str, Any] | None = None,
    optim: OptimSpec | None = DEFAULT_OPTIM,
    train: bool = False,
    module: nn.Module | None = None,
) -> Strategy:
    """``strategy`` on this rank, set up on ``module`` (default: the strategy's
    ``build_module()``, the family's fresh fp32 module unless the strategy partitions it).

    ``options``: the strategy's options model or the ``parallel.<m>`` keys it takes.
    ``train``: what core's worker does after set-up (train mode, the default RNG
    seeded per replica); off, the module stays in the eval mode HF loads it in.
    """
    if not isinstance(options, StrategyOptions):
        options = strategy.options_model(**(options or {}))
    strat = strategy(ctx, family, options)
    strat.setup(strat.build_module() if module is None else module, optim)
    if train:
        assert strat.module is not None
        strat.module.train()
        torch.manual_seed(dropout_seed(ctx.seed, ctx.replica))
    return strat


# -- the step sequence: encoder role -------------------------------------------------------------
def encode(strat: Strategy, mb: int, inputs: list[dict[str, torch.Tensor]]) -> list[EmbeddingShard]:
    """This rank's shard of each sample of microbatch ``mb`` (floating inputs in the compute
    dtype, as the worker casts them)."""
    return strat.encode(mb, [cast_inputs(x, strat.ctx.dtype) for x in inputs])


def backward(strat: Strategy, mb: int, shards: list[EmbeddingShard], grads: list[torch.Tensor]) -> None:
    """Backward of microbatch ``mb`` from gradients of the shards' own rows."""
    strat.backward(mb, [s.value for s in shards], grads)


def encode_and_backward(
    strat: Strategy, mb: int, inputs: list[dict[str, torch.Tensor]], grads: list[torch.Tensor]
) -> list[EmbeddingShard]:
    """Encode, then backward each shard from its rows of its sample's full upstream gradient."""
    shards = encode(strat, mb, inputs)
    backward(strat, mb, shards, [g[s.positions] for s, g in zip(shards, grads)])
    return shards


def release(strat: Strategy, mb: int) -> None:
    """Drop what microbatch ``mb``'s forward kept for a backward that will not come."""
    strat.release(mb)


# -- the step sequence: LLM role -----------------------------------------------------------------
def loss_and_backward(
    strat: Strategy,
    mb: int,
    samples: list[dict[str, torch.Tensor]],
    embeds: list[dict[str, torch.Tensor]],
    scale: float,
) -> float:
    """Forward and backward of microbatch ``mb`` (loss sum times ``scale``); the loss sum."""
    return strat.loss_and_backward(mb, samples, embeds, scale)


def evaluate(strat: Strategy, samples: list[dict[str, torch.Tensor]], embeds: list[dict[str, torch.Tensor]]):
    """The strategy's forward-only loss of ``samples`` (``Strategy.evaluate``)."""
    return strat.evaluate(samples, embeds)


def loss_sum(strat: Strategy, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The strategy's summed loss of ``logits`` (vocab-parallel under TP)."""
    return strat.loss_sum(logits, labels)


def leaves(embeds: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Fresh leaf copies of encoder rows, so their gradient can be read after a backward."""
    return [{k: v.clone().requires_grad_(True) for k, v in e.items()} for e in embeds]


# -- the step sequence: reduction and the optimizer step ------------------------------------------
def reduce_gradients(strat: Strategy) -> None:
    """Reduce the gradients over the group (a collective)."""
    strat.reduce_gradients()


def reduce(strat: Strategy) -> float:
    """Reduce the gradients over the group; the group's exact squared grad norm."""
    reduce_gradients(strat)
    return strat.grad_norm_sq()


def full_grads(strat: Strategy) -> dict[str, torch.Tensor]:
    """The merged (unpartitioned) gradients, copied; a collective on every rank."""
    return {n: g.clone() for n, g in strat.full_grads().items()}


def full_state(strat: Strategy) -> dict[str, torch.Tensor]:
    """The merged parameters; a collective on every rank."""
    return strat.full_state_dict()


def current_lr(strat: Strategy) -> float:
    return strat.current_lr()


def step(strat: Strategy, norm_sq: float, max_norm: float | None = None, zero_grad: bool = True) -> None:
    """Optimizer step clipped to ``max_norm`` by the global norm (None: no clipping), then
    ``zero_grad`` (left out to read the stepped gradients' dtypes)."""
    strat.step(1.0 if max_norm is None else clip_coefficient(math.sqrt(norm_sq), max_norm))
    if zero_grad:
        strat.zero_grad()


def zero_grad(strat: Strategy) -> None:
    strat.zero_grad()


def state_bytes(strat: Strategy) -> int:
    """Bytes of parameters, gradients and optimizer state this rank holds."""
    return strat.state_bytes()


def finish_step(
    strat: Strategy, max_norm: float | None = None, zero_grad: bool = True
) -> tuple[float, dict[str, torch.Tensor]]:
    """What every rank runs after the microbatches of a step: reduce, the squared norm,
    the merged gradients (read before the step), the clipped step; ``(norm_sq, grads)``."""
    norm_sq = reduce(strat)
    grads = full_grads(strat)
    step(strat, norm_sq, max_norm, zero_grad)
    return norm_sq, grads


def state_dtypes(strat: Strategy) -> dict[str, set[torch.dtype]]:
    """Dtypes of parameters, gradients and (non-scalar) optimizer state as the optimizer sees
    them (``train.precision: bf16``: the float32 masters), and of the weights the forward uses."""
    assert strat.module is not None and strat.optimizer is not None
    weights = {p.dtype for p in strat.module.parameters()}
    opt = getattr(strat.optimizer, "optim", strat.optimizer)  # ZeRO-1: this rank's partition
    with strat.masters():
        return {
            "weight_dtypes": weights,
            "param_dtypes": {p.dtype for p in strat.module.parameters()},
            "grad_dtypes": {p.grad.dtype for p in strat.module.parameters() if p.grad is not None},
            "state_dtypes": {v.dtype for st in opt.state.values() for v in st.values() if v.dim() > 0},
        }


def state_census(strat: Strategy) -> dict[str, int]:
    """This rank's ``state_bytes`` with what it should be made of: the parameter elements it
    holds, those AdamW stepped (they have moments and, after a backward, a gradient), trainable
    ones that never got a gradient (no moments), frozen ones; and AdamW's scalar step counts."""
    from disagg.kit.sharding import fsdp

    assert strat.module is not None
    with strat.masters():
        opt = getattr(strat.optimizer, "optim", strat.optimizer)  # ZeRO-1: this rank's partition
        state = opt.state if opt is not None else {}
        params = list(strat.module.parameters())
        return {
            "state_bytes": strat.state_bytes(),
            "stepped_elements": sum(fsdp.local(p).numel() for p in params if state.get(p)),
            "idle_elements": sum(
                fsdp.local(p).numel() for p in params if p.requires_grad and not state.get(p)
            ),
            "frozen_elements": sum(fsdp.local(p).numel() for p in params if not p.requires_grad),
            "scalar_bytes": sum(
                v.element_size()
                for st in state.values()
                for v in st.values()
                if torch.is_tensor(v) and v.dim() == 0
            ),
        }


# -- results across the process boundary ----------------------------------------------------------
def dumps(obj: Any) -> bytes:
    """Plain bytes: tensors sent through a torch.multiprocessing queue are shared by file
    descriptor and die with the rank process before the parent reads them."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def loads(raw: bytes) -> Any:
    return torch.load(io.BytesIO(raw), weights_only=False)
