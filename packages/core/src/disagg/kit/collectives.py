"""Differentiable collectives along dim 0, on public ``torch.distributed`` calls only.

torch's functional collectives (``torch.distributed._functional_collectives``) are private and
move between releases: ``all_gather_single_autograd`` and ``reduce_scatter_single_autograd``
exist from 2.13, while 2.11 (the GPU host's torch) has ``all_gather_tensor_autograd`` instead,
which 2.13 deprecates. These three are the same pairs written once: forward and backward are
each one public collective (gloo and NCCL alike), so a torch release cannot take them away.

- :func:`gather_rows`: all-gather, backward reduce-scatters (sums) the gradient back to the
  rank that holds the rows;
- :func:`scatter_rows`: reduce-scatter (sum), backward all-gathers;
- :func:`all_to_all_rows`: all-to-all with split sizes, backward the reverse exchange;
- :func:`gathered_rows`: the plain all-gather, where no gradient flows back through it.

Callers count the bytes (:class:`~disagg.interfaces.comm.CommCounter`) where they call these.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single`` (the
#: old names warn there); 2.11 has only the old ones. Bound here at import, as torch's functional
#: collectives were: a wrapper that counts ``torch.distributed``'s calls while a library runs
#: (``disagg_zero.comm.counted``) must not count these too, whose callers count their bytes.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_to_all = dist.all_to_all_single


def gathered_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """:func:`gather_rows` outside autograd (no backward): every rank's equal ``x`` along dim 0."""
    x = x.contiguous()
    out = x.new_empty(x.shape[0] * dist.get_world_size(group), *x.shape[1:])
    all_gather_into(out, x, group=group)
    return out


def _scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    if x.shape[0] % n:
        raise ValueError(f"reduce-scatter of {x.shape[0]} rows over {n} ranks: rows must divide evenly")
    out = x.new_empty(x.shape[0] // n, *x.shape[1:])
    reduce_scatter_into(out, x.contiguous(), group=group)
    return out


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    _all_to_all(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _Adjoint(torch.autograd.Function):
    """``there`` forward, ``back`` (its adjoint) for the gradient: an all-gather and a
    reduce-scatter are each other's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, there, back) -> torch.Tensor:
        ctx.group, ctx.back = group, back
        return there(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.back(grad, ctx.group), None, None, None


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (list(out_splits), list(in_splits)), group
        return _exchange(x, list(out_splits), list(in_splits), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``x`` (equal shapes), rank after rank along dim 0."""
    return _Adjoint.apply(x, group, gathered_rows, _scatter)


def scatter_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of ``x`` over the ranks, this rank's equal share of its rows."""
    return _Adjoint.apply(x, group, _scatter, gathered_rows)


def all_to_all_rows(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """``x``'s rows sent ``in_splits[r]`` to rank ``r``; ``out_splits[r]`` received from each."""
    return _AllToAllRows.apply(x, out_splits, in_splits, group)
