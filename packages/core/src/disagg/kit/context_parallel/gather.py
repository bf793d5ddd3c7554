"""The keys and values of every context-parallel rank, in sequence order, differentiably.

Forward all-gathers this rank's rows along the sequence; backward reduce-scatters (sums) the
gradient of the gathered rows back to the rank that holds them, so each key/value gradient is
summed exactly once over the queries of every rank: :func:`disagg.kit.collectives.gather_rows`,
that pair on public collectives (gloo and NCCL alike). Bytes and calls go to the rank's
:class:`~disagg.interfaces.comm.CommCounter` as the textbook ring would send them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from disagg.interfaces.comm import CommCounter
from disagg.kit.collectives import gather_rows


def gather_sequence(
    x: torch.Tensor, order: torch.Tensor, group: dist.ProcessGroup, comm: CommCounter
) -> torch.Tensor:
    """``x`` of shape ``(batch, heads, local tokens, head_dim)`` from every rank of ``group``,
    as ``(batch, heads, all tokens, head_dim)`` in global order (``order``:
    :func:`~disagg.kit.context_parallel.split.gathered_order`)."""
    rows = x.permute(2, 0, 1, 3).contiguous()  # sequence first: the gather concatenates along it
    n = dist.get_world_size(group)
    nbytes = (n - 1) * rows.numel() * rows.element_size()
    comm.add("cp_all_gather", nbytes)
    full = gather_rows(rows, group)
    if full.requires_grad:

        def counted(grad: torch.Tensor) -> None:
            comm.add("cp_reduce_scatter", nbytes)

        full.register_hook(counted)
    return full.index_select(0, order).permute(1, 2, 0, 3)
