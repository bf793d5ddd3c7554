"""Run a function on N local gloo ranks without Ray: fast strategy unit tests.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, sets up
the default ``torch.distributed`` group over gloo, calls ``fn(rank, *args)`` in
each and returns the results in rank order. Exceptions in a rank are re-raised
in the caller with that rank named.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue as queue_mod
import signal
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_threads(world_size: int) -> int:
    """Intra-op threads per rank: the machine's cores shared out, at least one. Each spawned
    process would otherwise take every core, and N ranks on the same cores thrash over them
    (on 2 cores, 2 ranks ran tiny matmuls about twice as slow in CPU time)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    # a crash in native code (gloo, a kernel) prints every thread's Python stack to stderr: the
    # rank dies without reporting, and this is the only trace of where it was
    faulthandler.enable(all_threads=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(rank_threads(world_size))
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        out = fn(rank, *args)
        # plain pickle copies tensor data; the queue's own pickler would share
        # it by file descriptor, which dies with this process before the parent reads it
        queue.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report every failure to the parent, with its rank
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600) -> list[Any]:
    """Call ``fn(rank, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be importable (a module-level function) and its results picklable.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, out = queue.get(timeout=timeout)
            except queue_mod.Empty:  # some rank waits at a collective its peers never make
                missing = sorted(set(range(world_size)) - set(results))
                errors.append(f"ranks {missing} gave no result within {timeout} s (a hung collective?)")
                break
            if ok:
                results[rank] = pickle.loads(out)
            else:
                errors.append(f"rank {rank} failed:\n{out}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
        # a rank killed by a signal (a segfault in a native library, the OOM killer) reports
        # nothing itself: its peers only see a reset connection, so name it here
        errors += [
            f"rank {r} was killed by {signal.Signals(-p.exitcode).name}"
            for r, p in enumerate(procs)
            if p.exitcode is not None and p.exitcode < 0
        ]
        for p in procs:
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
