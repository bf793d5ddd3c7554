"""A dead actor is reported by module and rank; shutdown leaves no process behind."""

from __future__ import annotations

import time

import psutil
import pytest
import ray

from disagg.builtin.ddp import DDPStrategy
from disagg.interfaces import OptimSpec, StrategyOptions
from disagg.runtime.groups import GroupSpec
from disagg.runtime.orchestrator import GroupFailure, Orchestrator
from disagg.testing.toy import ToyEncoderFamily, ToyLMFamily, make_toy_dirs, put_samples, toy_samples

#: how long a worker may take to exit after shutdown: generous, so that a loaded
#: machine never fails it; a process that is still there after it will not leave
EXIT_WAIT_S = 300


def _alive(pids: list[int]) -> list[str]:
    """Those of ``pids`` still running (an exited process its parent has not reaped
    yet, a zombie, is gone), described."""
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"pid {pid} ({p.name()}, {p.status()})")
        except psutil.NoSuchProcess:
            continue
    return out


def _survivors(pids: list[int]) -> list[str]:
    """Poll until every one of ``pids`` is gone; those still running after ``EXIT_WAIT_S``."""
    deadline = time.monotonic() + EXIT_WAIT_S
    while (alive := _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


def test_dead_actor_is_named_and_shutdown_is_clean(ray_local, tmp_path):
    enc, lm = make_toy_dirs(tmp_path)
    optim = OptimSpec(lr=1e-2)
    orch = Orchestrator(
        [
            GroupSpec("vision", ToyEncoderFamily(enc), DDPStrategy, StrategyOptions(), 1, 1, optim),
            GroupSpec("llm", ToyLMFamily(lm), DDPStrategy, StrategyOptions(), 1, 2, optim),
        ]
    )
    pids = [p["pid"] for g in orch.groups for p in ray.get(g.placements())]
    try:
        orch.step(put_samples(toy_samples(4)))
        ray.kill(orch.group("llm").actors[1])
        with pytest.raises(GroupFailure, match=r"module 'llm' rank 1 died"):
            orch.step(put_samples(toy_samples(4, seed=1), start=4))
    finally:
        orch.shutdown()
    survivors = _survivors(pids)
    assert not survivors, f"worker processes still running {EXIT_WAIT_S} s after shutdown: {survivors}"


def test_mismatched_collective_fails_within_the_timeout_naming_module_and_ranks(ray_local, tmp_path):
    """A rank that skips a collective its peers make: the peers' wait ends
    after ``collective_timeout_s`` with an error naming the module, the ranks
    and the step, instead of hanging for the 10-minute default."""
    from disagg.testing.faults import SkipsCollective

    enc, lm = make_toy_dirs(tmp_path)
    optim = OptimSpec(lr=1e-2)
    orch = Orchestrator(
        [
            GroupSpec("vision", ToyEncoderFamily(enc), DDPStrategy, StrategyOptions(), 1, 1, optim),
            GroupSpec("llm", ToyLMFamily(lm), SkipsCollective, StrategyOptions(), 1, 2, optim),
        ],
        collective_timeout_s=5,
    )
    try:
        with pytest.raises(GroupFailure) as err:
            orch.step(put_samples(toy_samples(4)))
    finally:
        orch.shutdown()
    msg = str(err.value)
    assert "step 1" in msg and "module 'llm' rank 0" in msg, msg
    assert "finished this phase: module 'llm' rank 1" in msg, msg  # the rank that skipped
    # what ended the wait: the peer's own collective timeout at the configured 5 s
    # (gloo names it), not the driver's stall watchdog (65 s) nor the 10-minute default
    assert "Timed out waiting 5000ms" in msg and "no rank finished a call" not in msg, msg
    assert (err.value.module, err.value.rank, err.value.collective) == ("llm", 0, "all_reduce")
