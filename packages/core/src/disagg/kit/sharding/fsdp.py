"""A module's parameters, gradients and AdamW state sharded over its group with torch FSDP2
(``parallel.<module>.shard: gradients | parameters``; :mod:`disagg.kit.sharding` picks).

``fully_shard`` wraps every Hugging Face block (``GradientCheckpointingLayer``: the layers
``recompute`` checkpoints) and then the module itself, whose unit holds the rest (patch
embedding, merger, projector). Every tensor is split along dim 0 over all ``degree x replicas``
ranks of the group (``Shard(0)`` DTensors); ``reshard_after_forward`` is what tells the two
modes apart:

- ``parameters`` (ZeRO-3): a block's parameters are gathered for its forward, freed after it,
  gathered again for its backward; at rest a rank holds 1/N of parameters, gradients, AdamW.
- ``gradients`` (ZeRO-2): gathered at a block's first forward of a microbatch and kept whole
  until that microbatch's backward has passed it; gradients are reduce-scattered in backward
  and AdamW steps the shard. At rest a rank holds 1/N of everything, but from a forward to its
  backward the whole parameters exist: :func:`held_bytes` counts them as held.

FSDP2's collectives run on a process group of their own, so they can never interleave with
a strategy's all-to-alls on the group's world, and through the group's
:class:`~disagg.interfaces.CommCounter` (:func:`counted_comms`, FSDP2's
``set_custom_all_gather``/``set_custom_reduce_scatter``), so ``comm_bytes`` counts them.
Gradients are **summed** (divide factor 1, sum-only reductions): the loss is already divided
by the global label count.

Families call submodules directly (Qwen's ulysses forward runs its blocks one by one; LLaVA
calls tower then projector), so the root unit cannot be the module itself, whose ``forward``
may or may not run (and would be entered twice when it does): the root is a :class:`Root`
around it, whose forward runs any function of the module (:func:`call`), gathering the rest of
the parameters around it. The module keeps its names (its parameters become DTensors in place).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disagg.interfaces.context import GroupContext


class Root(nn.Module):
    """The root FSDP unit: holds the module, and its forward is a call of any function of it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.inner = module

    def forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.inner, *args)


def blocks(module: nn.Module) -> list[nn.Module]:
    """The units FSDP2 gathers one at a time: Hugging Face's gradient-checkpointing layers."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in module.modules() if isinstance(m, GradientCheckpointingLayer)]


def shard_module(module: nn.Module, ctx: GroupContext, mode: str, offload: bool = False) -> Root:
    """``fully_shard`` per block, then a :class:`Root` around the module (its parameters become
    DTensors in place); collective over the group (a new process group). ``mode``:
    ``gradients`` or ``parameters``; ``offload``: the shards, their gradients and the AdamW
    state in host memory (``offload: optimizer``, FSDP2's ``CPUOffloadPolicy``)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    units = blocks(module)
    if not units:
        raise ValueError(
            f"parallel.{ctx.module}.shard: {mode}: {type(module).__name__} has no Hugging Face "
            "gradient-checkpointing layers to shard one at a time; allowed: none, optimizer"
        )
    group = dist.new_group(list(range(ctx.world_size)), timeout=ctx.collective_timeout)
    mesh = DeviceMesh.from_group(group, ctx.device.type)
    recipe = ctx.recipe
    mp = None
    if recipe is not None and recipe.master is not None:
        # bf16: the fp32 shards are the masters; blocks gathered in bf16 for compute, gradients
        # reduce-scattered in fp32 onto the fp32 shards (the Megatron/FSDP standard)
        mp = MixedPrecisionPolicy(param_dtype=recipe.weights, reduce_dtype=recipe.grads)
    elif recipe is not None and recipe.weights != torch.float32:
        from disagg.kit.masters import cast_floating

        cast_floating(module, recipe.weights)  # bf16-pure: the shards themselves are bf16
    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": mode == "parameters"}
    if mp is not None:
        kw["mp_policy"] = mp
    if offload:
        from disagg.kit.offload import fsdp_offload_policy

        kw["offload_policy"] = fsdp_offload_policy(ctx.device)
    for unit in units:
        fully_shard(unit, **kw)
    root = Root(module)
    if mp is not None:
        # the root's arguments are the strategy's own objects (a ulysses runtime, a layout), which
        # FSDP's input cast would rebuild as copies; the worker already cast the inputs
        kw["mp_policy"] = MixedPrecisionPolicy(mp.param_dtype, mp.reduce_dtype, cast_forward_inputs=False)
    fully_shard(root, **kw)
    gather, scatter = counted_comms(ctx.comm)
    for m in root.modules():
        if isinstance(m, FSDPModule):
            if hasattr(m, "set_custom_all_gather"):  # torch >= 2.8; before, FSDP2's bytes go uncounted
                m.set_custom_all_gather(gather)
                m.set_custom_reduce_scatter(scatter)
            # a sum, exactly once (FSDP's default divides by the world size); gloo has no PREMUL_SUM
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return root


def counted_comms(counter: Any) -> tuple[Any, Any]:
    """FSDP2's all-gather and reduce-scatter (its ``AllGather``/``ReduceScatter`` interface:
    ``allocate`` and the call, as its defaults do them) through ``counter``'s counted
    collectives: the bytes FSDP2 moves appear in the step's ``comm_bytes`` by kind."""

    def allocate(size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    # FSDP2 calls them with its interface's keywords
    class AllGather:
        def __call__(self, output_tensor, input_tensor, group, async_op=False):  # noqa: ANN001, ANN204
            return counter.all_gather_single(output_tensor, input_tensor, group, async_op)

    class ReduceScatter:
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001, ANN204
            return counter.reduce_scatter_single(output_tensor, input_tensor, group, op, async_op)

    AllGather.allocate = staticmethod(allocate)  # type: ignore[attr-defined]
    ReduceScatter.allocate = staticmethod(allocate)  # type: ignore[attr-defined]
    return AllGather(), ReduceScatter()


def call(root: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(module, *args)`` as a forward of the root unit (the parameters outside the blocks
    gathered around it; each block gathers its own)."""
    return root(fn, *args)


def reshard(root: nn.Module) -> None:
    """Every unit of ``root`` back to its shards: after a forward without gradients under
    ``gradients`` (``reshard_after_forward=False``), which no backward follows, the whole
    parameters would otherwise stay registered in the module (and its ``.grad``s out of sight)."""
    from torch.distributed.fsdp import FSDPModule

    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def is_sharded(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def rows(param: torch.Tensor) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[slice, ...]]]]:
    """Where a FSDP2 parameter (a ``Shard(0)`` DTensor over the group) and its AdamW moments
    lie in the full form: this rank's rows, ``torch.chunk``'s ``ceil(D / N)`` per rank (FSDP2's
    split; a rank past the end holds none), as a checkpoint layout (full shape, pieces)."""
    from torch.distributed.tensor import Shard

    full = tuple(param.shape)
    placements, mesh = param.placements, param.device_mesh  # type: ignore[attr-defined]
    if tuple(placements) != (Shard(0),):
        raise ValueError(f"a sharded checkpoint expects FSDP2's Shard(0), got {placements}")
    per_rank = -(-full[0] // mesh.size())
    start = min(mesh.get_local_rank() * per_rank, full[0])
    held = local(param).shape[0]
    if held != min(full[0], start + per_rank) - start:
        raise ValueError(f"FSDP2 shard of {held} rows at row {start} of {full}: not torch.chunk's split")
    if held == 0:
        return full, []
    return full, [((start,) + (0,) * (len(full) - 1), ())]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's elements of ``t`` (its shard; FSDP's padding excluded)."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined]


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (an all-gather when sharded), detached on the CPU."""
    return (t.full_tensor() if is_sharded(t) else t).detach().cpu().clone()  # type: ignore[attr-defined]


def like(reference: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor) laid out as ``reference`` (a DTensor: this rank keeps its shard)."""
    if not is_sharded(reference):
        return value.to(reference.device, reference.dtype).clone()
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        value.to(reference.device, reference.dtype),
        reference.device_mesh,  # type: ignore[attr-defined]
        reference.placements,  # type: ignore[attr-defined]
        src_data_rank=None,  # every rank has the whole value: each keeps its own chunk, no broadcast
    )


def whole_param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters currently held whole (gathered) on this rank."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if not is_sharded(p))
