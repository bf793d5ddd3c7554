"""The ``megatron_tp`` strategy's state in the layout-free full form: every
tensor merged from its TP shards through its :class:`~disagg_llm_tp.layers.ShardSpec`
(and cut again on load), weights, gradients and AdamW moments alike.

A component the strategy holds (``MegatronTPStrategy.form``) and its state-adapter methods
call, kept apart from the step: it is given the module and optimizer it reads and writes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disagg.interfaces import GroupContext
from disagg.kit.roles.state import Layout
from disagg_llm_tp.load import local_pieces
from disagg_llm_tp.shard_spec import ShardSpec, local_slice, merge


def _spec(t: torch.Tensor) -> ShardSpec:
    return getattr(t, "tp_spec", ShardSpec("replicated"))


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state tensors (parameters as themselves: their ``tp_spec``), without
    megatron's placeholder for Transformer Engine state."""
    return {
        k: v
        for k, v in module.state_dict(keep_vars=True).items()
        if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
    }


class TPFullForm:
    """Full-form state of one TP rank: merges over ``group`` (the TP group, :meth:`bind`)."""

    def __init__(self, ctx: GroupContext) -> None:
        self.ctx = ctx
        self.group: Any = None

    def bind(self, group: Any) -> None:
        """The TP process group, once megatron's parallel state exists."""
        self.group = group

    def gather(self, t: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        """The full tensor of this rank's piece ``t`` (a CPU copy)."""
        if spec.kind == "replicated" or self.ctx.degree == 1:
            full = merge([t.detach()], spec) if spec.kind == "vocab" else t.detach()
        else:
            full = merge(self.all_gather(t.detach()), spec)
        return full.cpu().clone()

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every TP rank's ``t``, in shard order (counted)."""
        t = t.contiguous()
        pieces = [torch.empty_like(t) for _ in range(self.ctx.degree)]
        self.ctx.comm.all_gather_bytes(t, group=self.group)
        dist.all_gather(pieces, t, group=self.group)
        return pieces

    def state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return {k: self.gather(v, _spec(v)) for k, v in _tensors(module).items()}

    def grads(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return {n: self.gather(p.grad, p.tp_spec) for n, p in module.named_parameters() if p.grad is not None}

    def optimizer_state(self, module: nn.Module, optimizer: Any) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW moments merged through each parameter's shard spec, like the
        weights; ranks agree which parameters have state (``agree_on_grads``
        gave them the same gradients to step on), so they gather the same."""
        if optimizer is None:
            return {}
        out = {}
        for name, p in module.named_parameters():
            st = optimizer.state.get(p)
            if st:
                out[name] = {
                    k: v.detach().cpu().clone() if v.dim() == 0 else self.gather(v, p.tp_spec)
                    for k, v in st.items()
                    if torch.is_tensor(v)
                }
        return out

    def load(
        self,
        module: nn.Module,
        optimizer: Any,
        params: dict[str, torch.Tensor],
        optim_state: dict[str, dict[str, torch.Tensor]],
    ) -> None:
        """This TP rank's slice of every full tensor (the inverse of the merge)."""
        shard, degree = self.ctx.shard, self.ctx.degree
        with torch.no_grad():
            for name, t in _tensors(module).items():
                if name not in params:
                    raise KeyError(f"checkpoint has no tensor {name!r} for module {self.ctx.module!r}")
                t.copy_(local_slice(params[name], _spec(t), shard, degree).to(t.device, t.dtype))
        if optimizer is None:
            return
        for name, p in module.named_parameters():
            if name in optim_state:
                optimizer.state[p] = {
                    k: v.clone()
                    if v.dim() == 0
                    else local_slice(v, p.tp_spec, shard, degree)
                    .to(p.device, p.dtype)
                    .clone(memory_format=torch.contiguous_format)
                    for k, v in optim_state[name].items()
                }

    def layout(self, param: torch.Tensor) -> Layout:
        """Where this rank's piece of ``param`` lies in the full tensor (sharded
        checkpoints): the pieces the sliced load reads (:func:`local_pieces`), with the
        vocabulary's padding rows left out; key/value copies and replicas list the same
        piece (written once)."""
        spec = _spec(param)
        full = full_shape(spec, list(param.shape), self.ctx.degree)
        where = []
        for dst, src, rows, cols in local_pieces(spec, full, self.ctx.shard, self.ctx.degree):
            if not full:
                where.append(((), ()))
                continue
            offsets = [src] + [0] * (len(full) - 1)
            if cols.start is not None:
                offsets[1] = cols.start
            where.append((tuple(offsets), (slice(dst, dst + rows),)))
        return tuple(full), where


def full_shape(spec: ShardSpec, local: list[int], degree: int) -> list[int]:
    """The full tensor's shape from a rank's local one."""
    if spec.kind == "replicated" or not local:
        return local
    if spec.kind == "row":
        return [local[0], local[1] * degree, *local[2:]]
    if spec.kind == "vocab":
        return [spec.full_rows, *local[1:]]
    if spec.kind == "kv_replicated":
        return [local[0] * spec.num_heads, *local[1:]]
    return [local[0] * degree, *local[1:]]
