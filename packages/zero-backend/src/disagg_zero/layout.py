"""The ``zero`` strategy's sharded-checkpoint layout: each rank states the pieces of the full
form it holds in DeepSpeed's own partitions, so that ``checkpoint.format: sharded`` writes
about 1/d of the group's state per rank and a load (from any layout) fills the partitions in
place, never gathering a whole tensor (:mod:`disagg.kit.checkpoint`).

What a rank holds of a trained parameter is one contiguous range of its flattened full tensor:

* stage 3: its flat partition, ``ceil(numel / d)`` elements at ``rank * ceil(numel / d)``
  (DeepSpeed pads the last ranks' past the end; a rank past the end holds nothing), whose fp32
  master and AdamW moments live in the optimizer's flat fp32 partitions (DeepSpeed's
  ``_get_fp32_opt_state_partition``, the tensor behind ``safe_get_local_fp32_param`` /
  ``safe_get_local_optimizer_state``, taken as a view so that a load writes it in place; the
  local getters copy it to the accelerator, which under ``offload_optimizer`` is not where it
  lives). Persistent (small) parameters are held whole for compute but partitioned in the
  optimizer all the same: their pieces are the partitions too.
* stages 1-2: its fragment in this rank's fp32 partition (``param._hp_mapping``: the range
  ``lp_fragment_address`` of the parameter, the tensors ``hp_fragment`` and, per AdamW state,
  ``get_hp_fragment(key)``); a rank whose partition holds none of it (``_hp_mapping`` None)
  lists nothing. The module's weights are whole on every rank but are a copy (lower
  precision under a bf16 recipe): the fp32 masters are what is saved.

A range of a row-major tensor is a union of at most ``2 * ndim - 1`` rectangles (a partial
first row, whole rows, a partial last row, recursively in the last dimensions:
:func:`flat_range_chunks`), each a view of the contiguous local range; DCP's resharding
reads them from, and writes them into, any other layout's pieces. Frozen parameters: their
ZeRO-3 partition (``ds_tensor``, the only copy there is), or, under stages 1-2, whole on
every rank like buffers (DCP writes equal pieces once). Step counts (AdamW's ``step``, per
parameter as the reference counts them: :class:`~disagg_zero.optim.MaskedAdamW`'s fragment
steps, the largest over the group, as no rank may hold a fragment) are scalars every rank
lists. A load fills the partitions and the steps' scalars; :meth:`ZeroLayout.refresh` (through
the strategy's ``refresh_weights``, which the worker calls after every load) then writes the step
counts into the fragments and the masters into the module's weights: stages 1-2 through
DeepSpeed's ``update_lp_params`` (each rank's partition copied into the weights, then
all-gathered), stage 3 by copying every fp32 partition into its parameter partition (DeepSpeed's
``_reassign_or_swap_out_partitioned_parameters``) and re-gathering the persistent
parameters, as DeepSpeed's step ends.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from disagg.kit.roles.state import Pieces

if TYPE_CHECKING:
    from disagg_zero.fullstate import ZeroFullState

#: AdamW's per-element states (moments), stated as the parameter's pieces
MOMENTS = ("exp_avg", "exp_avg_sq")


def flat_range_chunks(
    shape: tuple[int, ...], start: int, stop: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The rectangles ``(offsets, sizes)`` whose union is the elements ``[start, stop)`` of a
    row-major tensor of ``shape``, in that order (each contiguous in the flat order)."""
    if start >= stop:
        return
    if not shape:
        yield (), ()
        return
    if len(shape) == 1:
        yield (start,), (stop - start,)
        return
    row = math.prod(shape[1:])
    first, head = divmod(start, row)
    last, tail = divmod(stop, row)
    rest = len(shape) - 1
    if first == last:  # inside one row
        for o, s in flat_range_chunks(shape[1:], head, tail):
            yield (first, *o), (1, *s)
        return
    if head:  # the first row's end
        for o, s in flat_range_chunks(shape[1:], head, row):
            yield (first, *o), (1, *s)
        first += 1
    if last > first:  # whole rows
        yield (first, *(0,) * rest), (last - first, *shape[1:])
    if tail:  # the last row's beginning
        for o, s in flat_range_chunks(shape[1:], 0, tail):
            yield (last, *o), (1, *s)


def range_pieces(
    shape: tuple[int, ...], start: int, local: torch.Tensor
) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], torch.Tensor]]]:
    """Pieces of a full tensor of ``shape`` whose flat elements ``[start, start + n)`` are the
    1-D tensor ``local`` (a view of live storage): views of ``local``, one per rectangle."""
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    parts = []
    for offsets, sizes in flat_range_chunks(shape, start, start + local.numel()):
        at = sum(o * s for o, s in zip(offsets, strides)) - start
        parts.append((offsets, local.narrow(0, at, math.prod(sizes)).view(sizes)))
    return shape, parts


class ZeroLayout:
    """Sharded-checkpoint pieces of a :class:`~disagg_zero.strategy.ZeroStrategy` with an engine
    (its ``layout``), from its :class:`~disagg_zero.fullstate.ZeroFullState` (``full``), whose
    helpers it uses."""

    def __init__(self, full: ZeroFullState) -> None:
        self.full = full
        #: after a load's pieces were handed out: the step scalars it fills, per trainable index
        self._loading: dict[int, torch.Tensor] | None = None

    def pieces(self, saved: Mapping[str, Any] | None = None) -> Pieces:
        """This rank's pieces of the full form in DeepSpeed's partitions (module docstring);
        collective (the step counts' maximum). ``saved`` (a load): the optimizer state it
        holds is created here (zeros) for the checkpoint to fill; call :meth:`refresh` once it
        has."""
        full = self.full
        module, optimizer = full.module, full.optimizer
        trained = {id(p): i for i, p in enumerate(full.owner._params)}
        with_state = optimizer is not None and (saved is None or any(k.startswith("optim/") for k in saved))
        if with_state:
            if saved is not None:
                full.init_optimizer_state()
                self._zero_optimizer_state()
            full.link_optimizer_state()
        out: Pieces = {}
        for name, t in module.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor) or name.endswith("_extra_state"):
                continue
            if id(t) in trained and optimizer is not None:
                out[f"param/{name}"] = self._master_pieces(t, None)
            elif hasattr(t, "ds_tensor"):  # a frozen ZeRO-3 parameter: its partition
                out[f"param/{name}"] = self._partition_pieces(t, t.ds_tensor.detach().view(-1))
            else:  # a buffer, a stage 1-2 frozen parameter: whole on every rank
                out[f"param/{name}"] = (tuple(t.shape), [((0,) * t.dim(), t.detach())])
        if not with_state:
            return out
        steps = full.param_steps() if saved is None else []
        loading: dict[int, torch.Tensor] = {}
        self._loading = loading if saved is not None else None
        for i, (name, p) in enumerate(full.named_params()):
            if saved is None:
                if steps[i] == 0:
                    continue  # never stepped: no state, as the full form leaves it out
                step = torch.tensor(float(steps[i]))
            else:
                meta = saved.get(f"optim/{name}/step")
                if meta is None:
                    continue  # none saved: zero moments, no step, as the full form's load
                step = torch.zeros((), dtype=meta.properties.dtype)
                loading[i] = step
            for k in MOMENTS:
                out[f"optim/{name}/{k}"] = self._master_pieces(p, k)
            out[f"optim/{name}/step"] = ((), [((), step)])
        return out

    def refresh(self) -> None:
        """After a load filled the pieces :meth:`pieces` gave: step counts into
        :class:`~disagg_zero.optim.MaskedAdamW`'s fragments, fp32 masters into the module's
        weights (module docstring). Collective; nothing after any other load."""
        loading, self._loading = self._loading, None
        full = self.full
        if loading is None or full.engine is None:
            return
        if full.optimizer is not None:
            n = len(full.owner._params)
            full.set_steps([float(loading[i]) if i in loading else 0.0 for i in range(n)])
        with torch.no_grad():
            if full.stage == 3:
                self._refresh_partitions()
            elif full.optimizer is not None:
                full.engine.optimizer.update_lp_params()

    # -- pieces --------------------------------------------------------------------------------------
    def _master_pieces(self, p: nn.Parameter, key: str | None) -> tuple[tuple[int, ...], list]:
        """A trained parameter's fp32 master (``key`` None) or AdamW moment on this rank."""
        if self.full.stage == 3:
            opt = self.full.engine.optimizer
            part, _ = opt._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)  # noqa: SLF001
            return self._partition_pieces(p, part.view(-1))
        shape = tuple(p.shape)
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:  # none of it in this rank's partition
            return shape, []
        return range_pieces(shape, mapping.lp_fragment_address.start, mapping.get_hp_fragment(key).view(-1))

    def _partition_pieces(self, p: nn.Parameter, part: torch.Tensor) -> tuple[tuple[int, ...], list]:
        """ZeRO-3: the elements of ``p`` in this rank's flat partition ``part`` (its padding
        past the end of the tensor left out)."""
        shape = tuple(p.ds_shape)
        import torch.distributed as dist

        start = part.numel() * dist.get_rank(group=p.ds_process_group)
        held = max(0, min(part.numel(), p.ds_numel - start))
        return range_pieces(shape, start, part.narrow(0, 0, held))

    # -- after a load ----------------------------------------------------------------------------------
    def _zero_optimizer_state(self) -> None:
        """The AdamW state a load fills, zeroed first: a parameter the checkpoint has none
        for gets zero moments and no step, as under the full form's load."""
        for state in self.full.optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    v.zero_()

    def _refresh_partitions(self) -> None:
        """ZeRO-3: the fp32 masters into the parameters' partitions and the persistent
        parameters (held whole) gathered again, as DeepSpeed's step ends."""
        from disagg_zero.runtime import param_offload

        engine = self.full.engine
        offload = param_offload(engine)
        offload.partition_all_parameters()
        if self.full.optimizer is not None:
            opt = engine.optimizer
            for sub_group in range(len(opt.fp16_groups)):
                # DeepSpeed's own copy of an fp32 sub-group into its parameter partitions, as
                # its step ends
                opt._reassign_or_swap_out_partitioned_parameters(sub_group)  # noqa: SLF001
        persistent = offload.persistent_parameters
        if persistent:
            persistent[0].all_gather(persistent)
