"""``disagg.testing.dist.run_ranks`` names a rank that a signal killed: such a rank reports nothing
itself (a segfault in gloo's run loop left its peer with only "Connection reset by peer", and the
harness named the peer), so the caller's error must say which rank died and by what, and a rank
that crashes in native code prints where its Python threads were."""

from __future__ import annotations

import ctypes
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


def _rank_1_segfaults(rank: int) -> int:
    if rank == 1:
        ctypes.string_at(0)  # reads address 0: a segfault in native code, as gloo's was
    dist.barrier()
    return rank


def test_a_segfaulting_rank_is_named_with_its_python_stack(capfd):
    with pytest.raises(RuntimeError, match="rank 1 was killed by SIGSEGV"):
        run_ranks(_rank_1_segfaults, 2, timeout=60)
    err = capfd.readouterr().err
    assert "Segmentation fault" in err and "_rank_1_segfaults" in err, err[-2000:]
