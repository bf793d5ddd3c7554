"""Strategies that break the rules on purpose, for tests of failure handling.

Importable (unlike a test module) so Ray actors can unpickle them.
"""

from __future__ import annotations

from typing import ClassVar

from disagg.builtin.ddp import DDPStrategy


class SkipsCollective(DDPStrategy):
    """``ddp`` whose last rank skips the gradient reduction: its peers wait in
    a collective it never joins, as a buggy strategy's ranks would."""

    name: ClassVar[str] = "skips_collective"

    def reduce_gradients(self) -> None:
        if self.ctx.rank == self.ctx.world_size - 1:
            return
        super().reduce_gradients()


#: the text torch's NCCL watchdog gives a collective that timed out (torch 2.x)
NCCL_TIMEOUT = (
    "[PG ID 0 PG GUID 0(default_pg) Rank {rank}] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1234, NumelOut=1234, Timeout(ms)=600000) ran for "
    "600012 milliseconds before timing out."
)


class NcclTimeout(DDPStrategy):
    """``ddp`` whose last rank's gradient all-reduce fails as an NCCL timeout
    does under ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (communicators aborted, the
    error raised in the rank): a simulated NCCL failure, on CPU."""

    name: ClassVar[str] = "nccl_timeout"

    def reduce_gradients(self) -> None:
        import torch.distributed as dist

        if self.ctx.rank == self.ctx.world_size - 1:
            raise dist.DistBackendError(NCCL_TIMEOUT.format(rank=self.ctx.rank))
        # the peers would wait in the all-reduce until their own timeout; here they skip it
