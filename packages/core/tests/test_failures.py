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


def _gone(pids: list[int], timeout: float = 30) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.5)
    return False


def test_dead_actor_is_named_and_shutdown_is_clean(ray_local, tmp_path):
    enc, lm = make_toy_dirs(tmp_path)
    optim = OptimSpec(lr=1e-2)
    orch = Orchestrator(
        [
            GroupSpec("vision", ToyEncoderFamily(enc), DDPStrategy, StrategyOptions(), 1, 1, optim),
            GroupSpec("llm", ToyLMFamily(lm), DDPStrategy, StrategyOptions(), 1, 2, optim),
        ]
    )
    pids = [p["pid"] for g in orch.groups for p in ray.get(g.call("placement"))]
    try:
        orch.step(put_samples(toy_samples(4)))
        ray.kill(orch.group("llm").actors[1])
        with pytest.raises(GroupFailure, match=r"module 'llm' rank 1 died"):
            orch.step(put_samples(toy_samples(4, seed=1), start=4))
    finally:
        orch.shutdown()
    assert _gone(pids), "worker processes survived shutdown"


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
        t0 = time.monotonic()
        with pytest.raises(GroupFailure) as err:
            orch.step(put_samples(toy_samples(4)))
        elapsed = time.monotonic() - t0
    finally:
        orch.shutdown()
    msg = str(err.value)
    assert "step 1" in msg and "module 'llm' rank 0" in msg, msg
    assert "finished this phase: module 'llm' rank 1" in msg, msg  # the rank that skipped
    assert elapsed < 60, f"took {elapsed:.0f} s for a 5 s collective timeout"
