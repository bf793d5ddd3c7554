"""NCCL failures keep the diagnosis the gloo path gives: a rank whose
collective fails (simulated here: the NCCL watchdog's timeout error) is a
GroupFailure naming module, rank and collective, never ActorDied (which
recovery would restart into the same failure); a process the watchdog tore
down is mapped the same way."""

from __future__ import annotations

import pytest
import ray

from disagg.builtin.ddp import DDPStrategy
from disagg.interfaces import OptimSpec, StrategyOptions
from disagg.runtime.collectives import collective_name, is_collective_error
from disagg.runtime.groups import GroupSpec
from disagg.runtime.orchestrator import ActorDied, GroupFailure, Orchestrator, actor_failure
from disagg.testing.faults import NCCL_TIMEOUT, NcclTimeout
from disagg.testing.toy import ToyEncoderFamily, ToyLMFamily, make_toy_dirs, put_samples, toy_samples


def test_simulated_nccl_timeout_is_a_named_group_failure_not_a_dead_node(ray_local, tmp_path):
    enc, lm = make_toy_dirs(tmp_path)
    optim = OptimSpec(lr=1e-2)
    orch = Orchestrator(
        [
            GroupSpec("vision", ToyEncoderFamily(enc), DDPStrategy, StrategyOptions(), 1, 1, optim),
            GroupSpec("llm", ToyLMFamily(lm), NcclTimeout, StrategyOptions(), 1, 2, optim),
        ]
    )
    try:
        with pytest.raises(GroupFailure) as err:
            orch.step(put_samples(toy_samples(4)))
    finally:
        orch.shutdown()
    e = err.value
    assert not isinstance(e, ActorDied)  # run_training recovers from ActorDied only
    assert (e.module, e.rank, e.collective) == ("llm", 1, "all_reduce")
    assert "step 1" in str(e) and "module 'llm' rank 1: collective 'all_reduce' failed" in str(e), str(e)


def test_a_process_torn_down_by_the_watchdog_is_not_restarted():
    died = ray.exceptions.RayActorError(
        error_msg="The actor died unexpectedly: " + NCCL_TIMEOUT.format(rank=0)
    )
    got = actor_failure(died, "module 'vision' rank 3")
    assert type(got) is GroupFailure and (got.module, got.rank, got.collective) == ("vision", 3, "all_reduce")
    assert "not restarted" in str(got)
    gone = actor_failure(
        ray.exceptions.RayActorError(error_msg="The actor died unexpectedly."), "module 'llm' rank 0"
    )
    assert isinstance(gone, ActorDied) and gone.who == "module 'llm' rank 0"


def test_collective_names_from_nccl_and_the_last_counted_one():
    assert collective_name("WorkNCCL(SeqNum=3, OpType=_ALLGATHER_BASE, ...)") == "all_gather"
    assert collective_name("WorkNCCL(SeqNum=3, OpType=REDUCE_SCATTER)") == "reduce_scatter"
    assert collective_name("[gloo] Timed out waiting 5000ms for recv", "all_to_all") == "all_to_all"
    assert is_collective_error(
        "../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    )
    assert not is_collective_error(ValueError("shapes do not match"))
