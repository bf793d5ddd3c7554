"""The ``megatron_tp`` strategy's state in the layout-free full form: every
tensor merged from its TP shards through its :class:`~disagg_llm_tp.layers.ShardSpec`
(and cut again on load), weights, gradients and AdamW moments alike.

A mixin of :class:`disagg_llm_tp.strategy.MegatronTPStrategy` (the state
adapter role of core's contract), kept apart from the step; it uses the
strategy's ``module``, ``optimizer``, ``ctx`` and ``tp_group``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disagg.interfaces import GroupContext
from disagg.kit.masters import in_master_view
from disagg.kit.recompute.rng import ShardRNG
from disagg.kit.roles.state import Layout
from disagg_llm_tp.layers import ShardSpec, local_slice, merge
from disagg_llm_tp.load import local_pieces


class TPFullState:
    """Full-form state for :class:`MegatronTPStrategy`."""

    module: nn.Module | None
    optimizer: Any
    ctx: GroupContext
    tp_group: Any

    def _gather(self, t: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        if spec.kind == "replicated" or self.ctx.degree == 1:
            return merge([t.detach()], spec) if spec.kind == "vocab" else t.detach()
        return merge(self._tp_all_gather(t.detach()), spec)

    def _tp_all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every TP rank's ``t``, in shard order (counted)."""
        t = t.contiguous()
        pieces = [torch.empty_like(t) for _ in range(self.ctx.degree)]
        self.ctx.comm.all_gather_bytes(t, group=self.tp_group)
        dist.all_gather(pieces, t, group=self.tp_group)
        return pieces

    @in_master_view()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        out = {}
        for k, v in self.module.state_dict(keep_vars=True).items():
            if k.endswith("_extra_state") or not isinstance(v, torch.Tensor):
                continue  # megatron's placeholder for TE state
            spec = getattr(v, "tp_spec", ShardSpec("replicated"))
            out[k] = self._gather(v, spec).cpu().clone()
        return out

    @in_master_view()
    def full_grads(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        return {
            n: self._gather(p.grad, p.tp_spec).cpu().clone()
            for n, p in self.module.named_parameters()
            if p.grad is not None
        }

    @in_master_view()
    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW moments merged through each parameter's shard spec, like the
        weights; ranks agree which parameters have state (``agree_on_grads``
        gave them the same gradients to step on), so they gather the same."""
        if self.optimizer is None:
            return {}
        assert self.module is not None
        out = {}
        for name, p in self.module.named_parameters():
            st = self.optimizer.state.get(p)
            if not st:
                continue
            out[name] = {
                k: v.detach().cpu().clone() if v.dim() == 0 else self._gather(v, p.tp_spec).cpu().clone()
                for k, v in st.items()
                if torch.is_tensor(v)
            }
        return out

    @in_master_view(write=True)
    def load_full_state(
        self, params: dict[str, torch.Tensor], optim_state: dict[str, dict[str, torch.Tensor]]
    ) -> None:
        """This TP rank's slice of every full tensor (the inverse of the merge)."""
        assert self.module is not None
        shard, degree = self.ctx.shard, self.ctx.degree
        with torch.no_grad():
            for name, t in self.module.state_dict(keep_vars=True).items():
                if name.endswith("_extra_state") or not isinstance(t, torch.Tensor):
                    continue
                if name not in params:
                    raise KeyError(f"checkpoint has no tensor {name!r} for module {self.ctx.module!r}")
                spec = getattr(t, "tp_spec", ShardSpec("replicated"))
                t.copy_(local_slice(params[name], spec, shard, degree).to(t.device, t.dtype))
        if self.optimizer is None:
            return
        for name, p in self.module.named_parameters():
            if name in optim_state:
                self.optimizer.state[p] = {
                    k: v.clone()
                    if v.dim() == 0
                    else local_slice(v, p.tp_spec, shard, degree)
                    .to(p.device, p.dtype)
                    .clone(memory_format=torch.contiguous_format)
                    for k, v in optim_state[name].items()
                }

    def rng_state(self) -> dict[str, torch.Tensor]:
        """The TP stream (the default's) and, with adapter dropout, the stream every TP rank
        of a replica shares for the column adapters' masks: a same-layout resume continues
        both."""
        out = super().rng_state()  # type: ignore[misc]
        lora_rng: ShardRNG | None = getattr(self, "lora_rng", None)
        if lora_rng is not None:
            out["lora_dropout"] = lora_rng.state.cpu()
        return out

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        super().set_rng_state(state)  # type: ignore[misc]
        lora_rng: ShardRNG | None = getattr(self, "lora_rng", None)
        if lora_rng is not None and "lora_dropout" in state:
            lora_rng.state = state["lora_dropout"].clone()

    def tensor_layout(self, param: torch.Tensor) -> Layout:
        """Where this rank's piece of ``param`` lies in the full tensor (sharded
        checkpoints): the pieces the sliced load reads (:func:`local_pieces`), with the
        vocabulary's padding rows left out; key/value copies and replicas list the same
        piece (written once)."""
        spec: ShardSpec = getattr(param, "tp_spec", ShardSpec("replicated"))
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
