"""``disagg.testing.dist.run_ranks`` names a rank that a signal killed: such a rank reports nothing
itself (a segfault in gloo's run loop left its peer with only "Connection reset by peer", and the
harness named the peer), so the caller's error must say which rank died and by what."""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed as dist

from disagg.testing.dist import run_ranks


def _rank_1_dies(rank: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 waits here for a peer that is gone
    return rank


def test_a_rank_killed_by_a_signal_is_named():
    with pytest.raises(RuntimeError, match="rank 1 was killed by SIGKILL"):
        run_ranks(_rank_1_dies, 2, timeout=60)
