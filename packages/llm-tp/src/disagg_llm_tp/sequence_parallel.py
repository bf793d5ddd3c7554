"""Megatron sequence parallelism: the regions between the tensor-parallel blocks
(norms, residual adds, dropout) hold 1/degree of the tokens on each TP rank
instead of a full replica.

The three transitions are Megatron's (``megatron.core.tensor_parallel.mappings``):

- **split** where the hidden states enter the region (the first block's input,
  identical on every TP rank): keep this rank's tokens; backward all-gathers.
- **gather** after a norm whose output feeds column-parallel linears: all-gather
  the tokens; backward reduce-scatters, which also sums the column linears'
  partial input gradients (so those are built with ``disable_grad_reduce``).
- **reduce_scatter** of a row-parallel linear's partial output, replacing its
  all-reduce; backward all-gathers.

Why not megatron-core's own functions: in 0.16 its sequence-parallel mappings and
ColumnParallelLinear's sequence-parallel path allocate their buffers with
``torch.cuda.current_device()``, so they cannot run on CPU/gloo. These are the
same transitions on torch's autograd functional collectives, which run on gloo
and nccl alike. Gathering once after the norm (not inside every column linear,
as Megatron's fused-qkv layout allows) also all-gathers a norm output once for
Hugging Face's separate q/k/v (or gate/up) projections instead of three times.

A gathered tensor saved by the column linears for their weight gradients is
kept as this rank's shard and all-gathered again in backward (Megatron does the
same), so sequence parallelism saves activation memory there too. That holds in
a recomputed block's replay as well (``recompute: full``): the replay hands
checkpoint the shard, and the block's backward gathers it again, one all-gather
per gather more than the replay alone would cost, for ``(T - c)·H`` fewer elements
per gathered input while the block is in backward (``c = ceil(T/d)`` rows a rank
keeps of ``T``).

Tokens are the flattened leading dimensions (batch x sequence in decoders,
patches in vision encoders), zero-padded to a multiple of the degree. Padding
rows never reach a gathered output, so they receive no gradient.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from disagg.interfaces.comm import CommCounter
from disagg.kit.collectives import gather_rows, gathered_rows, scatter_rows


def _rows_per_rank(tokens: int, degree: int) -> int:
    return -(-tokens // degree)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    extra = rows - x.shape[0]
    return x if extra == 0 else torch.cat([x, x.new_zeros(extra, *x.shape[1:])])


class _Split(torch.autograd.Function):
    """This rank's rows of a tensor every TP rank holds in full; backward all-gathers."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, region: SequenceParallelRegion) -> torch.Tensor:
        ctx.region, ctx.tokens = region, flat.shape[0]
        c = _rows_per_rank(flat.shape[0], region.degree)
        return _pad_rows(flat, c * region.degree)[region.shard * c : (region.shard + 1) * c].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        full = ctx.region.all_gather(grad.contiguous())
        return full[: ctx.tokens], None


@dataclass
class SequenceParallelRegion:
    """The sequence-parallel state of one module on one TP rank."""

    group: dist.ProcessGroup
    degree: int
    shard: int
    comm: CommCounter
    #: shape of the hidden states that last entered the region (set by ``split``)
    shape: torch.Size | None = None

    def capture_shape(self) -> Callable[[], contextlib.AbstractContextManager[None]]:
        """At a checkpointed block's forward: the shape its gathers use, to be the
        region's again around the block's replay (:mod:`disagg.kit.recompute`)."""
        shape = self.shape

        @contextlib.contextmanager
        def restored() -> Iterator[None]:
            previous, self.shape = self.shape, shape
            try:
                yield
            finally:
                self.shape = previous

        return restored

    # -- the three transitions ---------------------------------------------------------------------
    def split(self, hidden: torch.Tensor) -> torch.Tensor:
        self.shape = hidden.shape
        return _Split.apply(hidden.reshape(-1, hidden.shape[-1]), self)

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """All tokens, in the shape of the hidden states that entered the region."""
        assert self.shape is not None, "sequence-parallel gather before any split"
        nbytes = self._count("all_gather", shard)
        full = gather_rows(shard, self.group)
        if full.requires_grad:
            full.register_hook(lambda _: self.comm.add("reduce_scatter", nbytes))
        tokens = self.shape[:-1].numel()
        out = full[:tokens].reshape(*self.shape[:-1], shard.shape[-1])
        self._remember(out, shard)
        return out

    def gather_rows(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of ``shard`` (equal row counts on every rank), rank after rank, flat:
        one tile of a tiled MLP's input (:mod:`disagg.kit.recompute.tiled_mlp`). A row-parallel
        linear's reduce-scatter of the tile's output then hands each rank back its own rows."""
        nbytes = self._count("all_gather", shard)
        full = gather_rows(shard, self.group)
        if full.requires_grad:
            full.register_hook(lambda _: self.comm.add("reduce_scatter", nbytes))
        return full

    def reduce_scatter(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel linear's partial outputs and keep this rank's tokens."""
        flat = partial.reshape(-1, partial.shape[-1])
        c = _rows_per_rank(flat.shape[0], self.degree)
        out = scatter_rows(_pad_rows(flat, c * self.degree), self.group)
        nbytes = self._count("reduce_scatter", out)
        if out.requires_grad:
            out.register_hook(lambda _: self.comm.add("all_gather", nbytes))
        return out

    # -- collectives -------------------------------------------------------------------------------
    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Plain (non-autograd) all-gather of equal shards along dim 0."""
        self._count("all_gather", shard)
        return gathered_rows(shard, self.group)

    def _count(self, op: str, shard: torch.Tensor) -> int:
        """Count one collective over equal shards like ``shard``; returns the bytes."""
        # Ring all-gather and reduce-scatter each send (n-1) shards per rank.
        nbytes = (self.degree - 1) * shard.numel() * shard.element_size()
        self.comm.add(op, nbytes)
        return nbytes

    # -- saving the shard instead of the gathered tensor -------------------------------------------
    def _remember(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        self._last = _Gathered(full, shard.detach(), self)

    @contextlib.contextmanager
    def save_shards(self) -> Iterator[None]:
        """While active, a save of the last gathered tensor (or a view of it) keeps
        only this rank's shard; backward all-gathers it again, once per gather.

        Saved-tensor hooks do not nest (the innermost wins), so hooks already
        active (the worker's activation-bytes counter) are applied to what is
        kept here: the shard, or any other tensor as it is."""
        last: _Gathered | None = getattr(self, "_last", None)
        if last is None or not torch.is_grad_enabled():
            yield
            return
        # In a checkpointed block (``recompute: full``) the outer hooks are checkpoint's: at the
        # forward they record what is saved (its shape: the shard here and in the replay alike,
        # which checkpoint checks), in the replay they keep it for the block's backward, which
        # then gets the shard and gathers it again. What is packed beside them holds no tensor,
        # so a checkpointed forward keeps nothing of the gather alive.
        outer = _active_saved_tensors_hooks()
        outer_pack, outer_unpack = outer or (_identity, _identity)
        again = last.again

        def pack(t: torch.Tensor):
            if last.matches(t):
                again.waiting += 1
                return (again, t.shape, outer_pack(last.shard))
            return (None, None, outer_pack(t))

        def unpack(packed) -> torch.Tensor:
            saved, shape, inner = packed
            value = outer_unpack(inner)
            return value if saved is None else saved.regather(value, shape)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


def _identity(t):
    return t


def _active_saved_tensors_hooks():
    # Private torch API (present since 2.0); without it outer hooks are not chained,
    # which only affects the activation-bytes metric, never the math.
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


class _Gathered:
    """One gather's output, recognised when a column linear saves it (or a whole view of it),
    and its shard, which is saved instead."""

    def __init__(self, full: torch.Tensor, shard: torch.Tensor, region: SequenceParallelRegion) -> None:
        # A weak reference: a freed gathered tensor's memory may be reused by another.
        self.ref = weakref.ref(full)
        self.ptr, self.numel, self.shard = full.data_ptr(), full.numel(), shard
        self.again = _Regather(region, full.numel())

    def matches(self, t: torch.Tensor) -> bool:
        """``t`` is the gathered tensor or a whole view of it."""
        alive = self.ref() is not None
        return alive and t.data_ptr() == self.ptr and t.numel() == self.numel and t.is_contiguous()


class _Regather:
    """What backward needs to gather a saved shard again (no tensor: it is packed beside the
    shard, whoever holds that), and the re-gathered tensor while some saved view of it is still
    waiting to be unpacked."""

    def __init__(self, region: SequenceParallelRegion, numel: int) -> None:
        self.region, self.numel = region, numel
        self.waiting = 0
        self.full: torch.Tensor | None = None

    def regather(self, shard: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if self.full is None:
            self.full = self.region.all_gather(shard)[: self.numel // shard.shape[-1]]
        out = self.full.view(shape)
        self.waiting -= 1
        if self.waiting <= 0:  # the last saved view is back: drop the full copy
            self.full, self.waiting = None, 0
        return out
