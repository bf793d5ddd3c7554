"""The mixin a replicated strategy (``ddp``, ``ulysses``) takes for ``parallel.<module>.shard``:
its state sharded at set-up, the reduction, norm and step of the shards, and the full form of
the sharded state (checkpoints, export, tests); the placeholder forward a rank without samples
runs so that every rank makes the same FSDP2 all-gathers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from disagg.interfaces.context import GroupContext
from disagg.kit.grads import sum_of_squares
from disagg.kit.masters import in_master_view
from disagg.kit.offload import offloaded
from disagg.kit.sharding import fsdp
from disagg.kit.sharding.modes import FSDP_MODES
from disagg.kit.sharding.optimizer import build_optimizer


def placeholder_input(family: Any, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """One black image, preprocessed by the family (what a rank without samples forwards), its
    pixels in the compute dtype ``dtype`` as the worker casts real inputs."""
    from PIL import Image

    from disagg.kit.masters import cast_inputs

    return cast_inputs(family.preprocess([Image.new("RGB", (28, 28))]), dtype)


def _state_bytes(states: Any) -> int:
    return sum(
        fsdp.local(v).numel() * v.element_size() for st in states for v in st.values() if torch.is_tensor(v)
    )


class ShardedReplicas:
    """Mixin before :class:`~disagg.kit.Strategy`: ``parallel.<module>.shard`` for a
    strategy whose ranks otherwise hold the whole module (its ``parallelize`` ends with
    :meth:`shard_state`)."""

    build_optimizer = staticmethod(build_optimizer)
    ctx: GroupContext
    options: Any
    module: nn.Module | None
    optimizer: Any
    scheduler: Any
    #: the largest whole-parameter bytes a ``gradients`` forward left gathered (held until backward)
    _whole_bytes: int = 0
    #: the FSDP2 root unit around the module (``gradients``/``parameters``)
    fsdp_root: nn.Module | None = None
    #: FSDP2 keeps the shards and the AdamW state in host memory (``offload: optimizer``)
    offload_policy: bool | None = None

    @property
    def shard_mode(self) -> str:
        return getattr(self.options, "shard", "none")

    @property
    def fsdp(self) -> bool:
        return self.shard_mode in FSDP_MODES and self.ctx.world_size > 1

    def shard_state(self, module: nn.Module) -> nn.Module:
        """The end of ``parallelize``: FSDP2 units under ``gradients``/``parameters``."""
        if self.fsdp:
            # FSDP2 applies train.precision itself: its policy casts the fp32 shards (bf16), or
            # the shards are bf16 (bf16-pure)
            offload = offloaded(self.options)
            self.fsdp_root = fsdp.shard_module(module, self.ctx, self.shard_mode, offload)
            self.offload_policy = offload or None
            self.precision_applied = True
        return module

    def sharded_call(self, fn: Any, *args: Any) -> Any:
        """``fn(module, *args)`` under the root unit; then what ``gradients`` keeps gathered."""
        assert self.fsdp_root is not None
        out = fsdp.call(self.fsdp_root, fn, *args)
        self.forwarded()
        return out

    def forwarded(self) -> None:
        """After a module call's forward: what ``gradients`` keeps gathered until backward."""
        if self.fsdp and self.shard_mode == "gradients" and self.module is not None:
            self._whole_bytes = max(self._whole_bytes, fsdp.whole_param_bytes(self.module))

    def max_count(self, n: int) -> int:
        """The most forwards any rank of the group runs in this call (one small all-reduce)."""
        counts = torch.zeros(self.ctx.world_size, dtype=torch.int64, device=self.ctx.device)
        counts[self.ctx.rank] = n
        self.ctx.comm.all_reduce(counts)  # a sum of one-hot counts: every rank's count
        return int(counts.max())

    # -- the parallelizer's reduction, norm and step ------------------------------------------------
    @in_master_view()
    def reduce_gradients(self) -> None:
        if self.fsdp:
            return  # FSDP2 reduce-scattered (summed) every block's gradients in backward
        super().reduce_gradients()  # type: ignore[misc]

    @in_master_view()
    def grad_norm_sq(self) -> float:
        if not self.fsdp:
            return super().grad_norm_sq()  # type: ignore[misc]
        assert self.module is not None
        mine = [
            fsdp.local(p.grad) for p in self.module.parameters() if p.requires_grad and p.grad is not None
        ]
        total = sum_of_squares(mine).to(self.ctx.device).reshape(1)
        self.ctx.comm.all_reduce(total)  # every shard once: FSDP's padding is not in to_local()
        return float(total)

    def step(self, clip_coef: float) -> None:
        if not self.fsdp:
            return super().step(clip_coef)  # type: ignore[misc]
        if self.optimizer is None:
            return
        assert self.module is not None
        if clip_coef < 1.0:
            grads = [fsdp.local(p.grad) for p in self.module.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, clip_coef)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    @in_master_view()
    def state_bytes(self) -> int:
        """Parameters + gradients + optimizer state this rank holds, from the tensors: shards
        under FSDP2 (plus the whole parameters a ``gradients`` step holds from forward to
        backward), this rank's partition of the AdamW state under ZeRO-1."""
        if self.shard_mode == "none" or self.ctx.world_size == 1:
            return super().state_bytes()  # type: ignore[misc]
        assert self.module is not None
        total = 0
        for p in self.module.parameters():
            total += fsdp.local(p).numel() * p.element_size()
            if p.grad is not None:
                total += fsdp.local(p.grad).numel() * p.grad.element_size()
        if self.optimizer is not None:
            states = self.optimizer.optim.state if self.shard_mode == "optimizer" else self.optimizer.state
            total += _state_bytes(states.values())
        return total + self._whole_bytes + self.precision_bytes()  # type: ignore[attr-defined]

    # -- the full form (checkpoints, export, tests) ---------------------------------------------------
    @in_master_view()
    def sharded_state(self, saved: Any = None) -> Any:
        """Sharded checkpoints: whole replicas (``shard: none``) hold every tensor whole (one
        of them writes it); FSDP2 ranks their rows of each parameter and AdamW moment
        (:meth:`tensor_layout`); ZeRO-1 ranks whole parameters and the AdamW state of their
        own partition (the inner optimizer's)."""
        if self.shard_mode == "optimizer" and self.ctx.world_size > 1 and self.optimizer is not None:
            inner = self.optimizer.optim
            owned = {id(p) for g in inner.param_groups for p in g["params"]}
            return self.layout_pieces(saved, optimizer=inner, owned=owned)  # type: ignore[attr-defined]
        return self.layout_pieces(saved)  # type: ignore[attr-defined]

    def tensor_layout(self, param: torch.Tensor) -> Any:
        """A FSDP2 parameter (a ``Shard(0)`` DTensor over the group) and its AdamW moments:
        this rank's rows, ``torch.chunk``'s ``ceil(D / N)`` per rank (FSDP2's split; a rank
        past the end holds none); any other tensor whole."""
        if not fsdp.is_sharded(param):
            return super().tensor_layout(param)  # type: ignore[misc]
        from torch.distributed.tensor import Shard

        full = tuple(param.shape)
        placements, mesh = param.placements, param.device_mesh  # type: ignore[attr-defined]
        if tuple(placements) != (Shard(0),):
            raise ValueError(f"a sharded checkpoint expects FSDP2's Shard(0), got {placements}")
        rows = -(-full[0] // mesh.size())
        start = min(mesh.get_local_rank() * rows, full[0])
        held = fsdp.local(param).shape[0]
        if held != min(full[0], start + rows) - start:
            raise ValueError(f"FSDP2 shard of {held} rows at row {start} of {full}: not torch.chunk's split")
        if held == 0:
            return full, []
        return full, [((start,) + (0,) * (len(full) - 1), ())]

    def local_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return fsdp.local(t)

    @in_master_view()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if not self.fsdp:
            return super().full_state_dict()  # type: ignore[misc]
        assert self.module is not None
        return {k: fsdp.full(v) for k, v in self.module.state_dict().items()}

    @in_master_view()
    def full_grads(self) -> dict[str, torch.Tensor]:
        if not self.fsdp:
            return super().full_grads()  # type: ignore[misc]
        assert self.module is not None
        return {n: fsdp.full(p.grad) for n, p in self.module.named_parameters() if p.grad is not None}

    def _trainable_order(self) -> list[nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    @in_master_view()
    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        if self.shard_mode == "none" or self.optimizer is None or self.ctx.world_size == 1:
            return super().full_optimizer_state()  # type: ignore[misc]
        assert self.module is not None
        names = {id(p): n for n, p in self.module.named_parameters()}
        if self.shard_mode == "optimizer":
            # the library's gather of every partition onto rank 0 (collective)
            self.optimizer.consolidate_state_dict(to=0)
            if self.ctx.rank != 0:
                return {}
            sd = self.optimizer.state_dict()
            order = self._trainable_order()
            return {
                names[id(order[i])]: {
                    k: v.detach().cpu().clone() for k, v in st.items() if torch.is_tensor(v)
                }
                for i, st in sd["state"].items()
            }
        out = {}
        for name, p in self.module.named_parameters():
            st = self.optimizer.state.get(p)
            if st:
                out[name] = {k: fsdp.full(v) for k, v in st.items() if torch.is_tensor(v)}
        return out

    @in_master_view(write=True)
    def load_full_state(
        self, params: dict[str, torch.Tensor], optim_state: dict[str, dict[str, torch.Tensor]]
    ) -> None:
        if not self.fsdp:
            super().load_full_state(params, {} if self.shard_mode == "optimizer" else optim_state)  # type: ignore[misc]
            if self.shard_mode == "optimizer" and self.optimizer is not None and self.ctx.world_size > 1:
                self._load_partition(optim_state)
            return
        assert self.module is not None
        with torch.no_grad():
            for name, t in self.module.state_dict(keep_vars=True).items():
                if name not in params:
                    raise KeyError(f"checkpoint has no tensor {name!r} for module {self.ctx.module!r}")
                fsdp.local(t).copy_(fsdp.local(fsdp.like(t, params[name])))
        if self.optimizer is None:
            return
        for name, p in self.module.named_parameters():
            if name in optim_state:
                self.optimizer.state[p] = {
                    k: v.clone() if k == "step" else fsdp.like(p, v) for k, v in optim_state[name].items()
                }

    def _load_partition(self, optim_state: dict[str, dict[str, torch.Tensor]]) -> None:
        """ZeRO-1: the AdamW state of the parameters this rank's partition steps."""
        assert self.module is not None
        owned = {id(p) for g in self.optimizer.optim.param_groups for p in g["params"]}
        for name, p in self.module.named_parameters():
            if id(p) in owned and name in optim_state:
                self.optimizer.optim.state[p] = {
                    k: v.clone() if k == "step" else v.to(p.device, p.dtype).clone()
                    for k, v in optim_state[name].items()
                }
