"""Collectives that count the bytes they move, for the ``comm_bytes`` metric.

Strategies call these instead of ``torch.distributed`` directly so that every
byte a rank sends is accounted for. Counts are what one rank *sends* under the
textbook algorithm (ring all-reduce sends 2(n-1)/n of the buffer; all-to-all
sends everything except its own chunk), so they do not depend on the backend.

A library's own collectives are counted where the library lets a caller supply them: FSDP2
(``parallel.<module>.shard: gradients | parameters``) issues its all-gathers and
reduce-scatters through :meth:`CommCounter.all_gather_single` and
:meth:`CommCounter.reduce_scatter_single` (:func:`disagg.kit.sharding.fsdp.counted_comms`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommCounter:
    bytes_by_op: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: collective calls by kind: each pays a fixed latency whatever its size
    calls_by_op: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: kind of the last collective counted: named when a collective fails and
    #: the backend's error does not say which (gloo)
    last_op: str | None = None
    #: of the all-reduces counted, those sent while backward still ran (``overlap_grad_reduce``)
    overlapped_calls: int = 0

    def add(self, op: str, nbytes: int, calls: int = 1) -> None:
        """Count ``calls`` collectives of kind ``op`` sending ``nbytes`` in all
        (``calls=0`` for bytes a library moves in calls it does not show)."""
        self.bytes_by_op[op] += int(nbytes)
        if calls:
            self.calls_by_op[op] += calls
            self.last_op = op

    def total(self) -> int:
        return sum(self.bytes_by_op.values())

    def calls(self) -> dict[str, int]:
        return dict(self.calls_by_op)

    def reset(self) -> dict[str, int]:
        """The bytes by kind since the last reset; both counts start again."""
        out = dict(self.bytes_by_op)
        self.bytes_by_op.clear()
        self.calls_by_op.clear()
        self.overlapped_calls = 0
        return out

    # -- counted collectives ---------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        n = dist.get_world_size(group)
        if n > 1:
            self.add("all_reduce", 2 * (n - 1) * _nbytes(tensor) // n)
            dist.all_reduce(tensor, group=group)

    def broadcast(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
        n = dist.get_world_size(group)
        if n > 1:
            if dist.get_rank() == src:
                self.add("broadcast", _nbytes(tensor))
            dist.broadcast(tensor, src=src, group=group)

    def all_gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 (torch's name)
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> dist.Work | None:
        """``all_gather_into_tensor`` (FSDP2's parameter all-gather): ``(n-1)`` x this rank's input."""
        self.all_gather_bytes(input, group)
        return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 (torch's name)
        group: dist.ProcessGroup | None = None,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> dist.Work | None:
        """``reduce_scatter_tensor`` (FSDP2's gradient reduce-scatter): ring reduce-scatter sends
        ``(n-1)/n`` of the input."""
        n = dist.get_world_size(group)
        self.add("reduce_scatter", (n - 1) * _nbytes(input) // n)
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)

    def all_gather_bytes(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        """Account for an all-gather whose input is ``tensor`` (done by the caller)."""
        n = dist.get_world_size(group)
        self.add("all_gather", (n - 1) * _nbytes(tensor))

    def all_to_all_bytes(self, send_counts: list[int], my_index: int, bytes_per_row: int) -> None:
        """Account for an all-to-all: rows sent to every peer but oneself."""
        self.add(
            "all_to_all",
            sum(c for i, c in enumerate(send_counts) if i != my_index) * bytes_per_row,
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
