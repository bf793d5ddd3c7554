"""The state adapter: a rank's module and optimizer state in the layout-free
full form (every tensor unpartitioned, named as in ``family.build()``'s
module), which checkpoints hold so that any layout resumes from any other's,
and the rank's own random streams (same layout only).

Sharded checkpoints (``checkpoint.format: sharded``, the default) never merge: each
rank states where its tensors lie in the full form (:meth:`StateAdapter.tensor_layout`,
of the local elements :meth:`StateAdapter.local_tensor` gives, gathered by
:meth:`StateAdapter.sharded_state` into :data:`Pieces`), and
``torch.distributed.checkpoint`` writes and reshards them
(:mod:`disagg.kit.checkpoint`)."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from disagg.interfaces.context import GroupContext
from disagg.kit.masters import in_master_view
from disagg.kit.recompute.rng import ShardRNG
from disagg.kit.sharding import fsdp, zero1

#: where a rank's tensor lies in its full form: (full shape, [(offsets in the full
#: tensor, index of the local tensor)]); several ranks may list the same piece
Layout = tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[slice, ...]]]]
#: full-form name -> (full shape, [(offsets, this rank's tensor of that piece)])
Pieces = dict[str, tuple[tuple[int, ...], list[tuple[tuple[int, ...], torch.Tensor]]]]


class FullForm(Protocol):
    """A strategy's own full form, held as a component (:attr:`StateAdapter.form`) when its
    tensors are partitioned its own way (``megatron_tp``: through each tensor's TP shard spec);
    the state adapter's defaults then call it, in the master view, with the rank's module and
    optimizer. Collective like those methods."""

    def state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]: ...
    def grads(self, module: nn.Module) -> dict[str, torch.Tensor]: ...
    def optimizer_state(self, module: nn.Module, optimizer: Any) -> dict[str, dict[str, torch.Tensor]]: ...
    def load(
        self,
        module: nn.Module,
        optimizer: Any,
        params: dict[str, torch.Tensor],
        optim_state: dict[str, dict[str, torch.Tensor]],
    ) -> None: ...
    def layout(self, param: torch.Tensor) -> Layout: ...


class StateAdapter:
    """Defaults for a module whose parameters and AdamW state every rank holds whole, or
    sharded over the group by :meth:`~.parallelizer.Parallelizer.shard_state` (FSDP2 shards
    are gathered, ZeRO-1's partitions consolidated: :mod:`disagg.kit.sharding`), or whose
    strategy holds its own :class:`FullForm` in :attr:`form`."""

    #: the strategy's own full form (None: the defaults below)
    form: FullForm | None = None

    def _zero1(self) -> bool:
        """``shard: optimizer`` over more than one rank: the AdamW state is partitioned."""
        return self.shard_mode == "optimizer" and self.optimizer is not None and self.ctx.world_size > 1

    ctx: GroupContext
    module: nn.Module | None
    optimizer: Any
    shard_mode: str
    if TYPE_CHECKING:

        def module_call(self) -> AbstractContextManager[None]: ...

        def masters(self, write: bool = False) -> AbstractContextManager[None]: ...

    @in_master_view()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Merged, unpartitioned parameters named as in ``family.build()``'s
        module. Collective: call on every rank; rank 0's result is complete."""
        assert self.module is not None
        if self.form is not None:
            return self.form.state_dict(self.module)
        with self.module_call():
            return {k: fsdp.full(v) for k, v in self.module.state_dict().items()}

    @in_master_view()
    def full_grads(self) -> dict[str, torch.Tensor]:
        """Merged gradients (after ``reduce_gradients``), named like
        :meth:`full_state_dict`; collective like it. A parameter that got no
        gradient anywhere is left out."""
        assert self.module is not None
        if self.form is not None:
            return self.form.grads(self.module)
        return {n: fsdp.full(p.grad) for n, p in self.module.named_parameters() if p.grad is not None}

    @in_master_view()
    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer state of every parameter that has some, merged like
        :meth:`full_state_dict` and under the same names:
        ``{name: {"exp_avg", "exp_avg_sq", "step"}}`` (AdamW). Parameters
        without state (never stepped) are left out. Collective; rank 0's
        result is complete."""
        if self.optimizer is None:
            return {}
        assert self.module is not None
        if self.form is not None:
            return self.form.optimizer_state(self.module, self.optimizer)
        if self._zero1():
            return zero1.full_state(self.optimizer, self.module, self.ctx.rank)
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
        """Take this rank's part of full parameters and optimizer state (the
        forms of :meth:`full_state_dict` and :meth:`full_optimizer_state`,
        possibly saved under another layout). Collective; every rank gets the
        full tensors."""
        assert self.module is not None
        if self.form is not None:
            self.form.load(self.module, self.optimizer, params, optim_state)
            return
        with torch.no_grad():
            for name, t in self.module.state_dict(keep_vars=True).items():
                if name not in params:
                    raise KeyError(f"checkpoint has no tensor {name!r} for module {self.ctx.module!r}")
                fsdp.local(t).copy_(fsdp.local(fsdp.like(t, params[name])))
        if self.optimizer is None:
            return
        if self._zero1():
            zero1.load_partition(self.optimizer, self.module, optim_state)
            return
        for name, p in self.module.named_parameters():
            if name in optim_state:
                self.optimizer.state[p] = {
                    # torch AdamW keeps its (non-capturable) step count on the CPU
                    k: v.clone() if k == "step" else fsdp.like(p, v)
                    for k, v in optim_state[name].items()
                }

    def rng_state(self) -> dict[str, torch.Tensor]:
        """Random streams of this rank's own beyond torch's default generators
        (core saves those): by default the per-shard dropout stream ``self.rng``
        when the strategy made one (:class:`~disagg.kit.recompute.rng.ShardRNG`), and
        the further ones it named in ``self.rng_streams``."""
        return {name: rng.state.cpu() for name, rng in self._streams().items()}

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`rng_state` returned (same layout only)."""
        for name, rng in self._streams().items():
            if name in state:
                rng.state = state[name].clone()

    def _streams(self) -> dict[str, ShardRNG]:
        rng = getattr(self, "rng", None)
        own = {"shard_dropout": rng} if isinstance(rng, ShardRNG) else {}
        return {**own, **getattr(self, "rng_streams", {})}

    # -- sharded checkpoints ----------------------------------------------------------------------
    def tensor_layout(self, param: torch.Tensor) -> Layout:
        """Where this rank's ``param`` (and each optimizer state of its shape) lies in the
        full form. Default: every rank holds it whole, or its FSDP2 rows
        (:func:`disagg.kit.sharding.fsdp.rows`); the strategy's :attr:`form`'s when it has one."""
        if self.form is not None:
            return self.form.layout(param)
        if fsdp.is_sharded(param):
            return fsdp.rows(param)
        return tuple(param.shape), [((0,) * param.dim(), ())]

    @in_master_view()
    def sharded_state(self, saved: Mapping[str, Any] | None = None) -> Pieces | None:
        """This rank's parameters (``param/<name>``, every tensor of the module's state
        dict) and optimizer state (``optim/<name>/<state>``) as pieces of the full form,
        aliasing the live tensors: what a sharded save writes and what a load fills in
        place. ``saved`` (a load): the checkpoint's tensor metadata by name; the
        optimizer state it holds is created here (zeros) to be filled. ``None``: this
        strategy states no layout (it changed the full form but not
        :meth:`tensor_layout`); its checkpoints then hold the full form."""
        if (
            type(self).full_state_dict is not StateAdapter.full_state_dict
            and type(self).tensor_layout is StateAdapter.tensor_layout
        ):
            return None
        if self._zero1():  # whole parameters, and the AdamW state of this rank's own partition
            inner = self.optimizer.optim
            owned = {id(p) for g in inner.param_groups for p in g["params"]}
            return self.layout_pieces(saved, optimizer=inner, owned=owned)
        return self.layout_pieces(saved)

    def layout_pieces(
        self, saved: Mapping[str, Any] | None = None, optimizer: Any = None, owned: set[int] | None = None
    ) -> Pieces:
        """:meth:`sharded_state` by :meth:`tensor_layout`, whatever the full form is (for a
        strategy whose own ``sharded_state`` decides when its layout holds). ``optimizer``:
        the one that holds this rank's state (default ``self.optimizer``; ZeRO-1's inner
        one); ``owned``: ids of the parameters whose state this rank keeps (default all)."""
        assert self.module is not None
        out: Pieces = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            if isinstance(t, torch.Tensor) and not name.endswith("_extra_state"):
                out[f"param/{name}"] = self._pieces(t, t.detach())
        opt = self.optimizer if optimizer is None else optimizer
        if opt is None:
            return out
        for name, p in self.module.named_parameters():
            if owned is not None and id(p) not in owned:
                continue
            if saved is not None:
                wanted = {k.rpartition("/")[2]: m for k, m in saved.items() if k.startswith(f"optim/{name}/")}
                if wanted:
                    opt.state[p] = {
                        # torch AdamW keeps its (non-capturable) step count on the CPU
                        k: torch.zeros((), dtype=m.properties.dtype) if not m.size else torch.zeros_like(p)
                        for k, m in wanted.items()
                    }
            for k, v in (opt.state.get(p) or {}).items():
                if torch.is_tensor(v):
                    out[f"optim/{name}/{k}"] = self._pieces(p, v) if v.dim() else ((), [((), v)])
        return out

    def local_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """The elements of ``t`` this rank stores, as :meth:`tensor_layout`'s indices index
        them: ``t`` itself, a DTensor's local shard under FSDP2."""
        return fsdp.local(t)

    def _pieces(self, param: torch.Tensor, t: torch.Tensor) -> tuple[tuple[int, ...], list]:
        size, where = self.tensor_layout(param)
        local = self.local_tensor(t)
        return size, [(offsets, local[index]) for offsets, index in where]
