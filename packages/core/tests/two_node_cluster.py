"""Run as a script by test_cluster.py: its own simulated 2-node Ray cluster
(a Ray driver can join only one cluster per process)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from disagg.builtin.ddp import DDPStrategy
from disagg.interfaces import OptimSpec, StrategyOptions
from disagg.runtime.groups import GroupSpec
from disagg.runtime.orchestrator import Orchestrator
from disagg.testing.reference import ReferenceModel
from disagg.testing.tolerance import assert_scalar_close
from disagg.testing.toy import ToyEncoderFamily, ToyLMFamily, make_toy_dirs, put_samples, toy_samples


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    enc, lm = make_toy_dirs(Path(tempfile.mkdtemp()))
    optims = {
        "vision": OptimSpec(lr=1e-2, eps=1e-3, total_steps=2),
        "llm": OptimSpec(lr=1e-2, eps=1e-3, total_steps=2),
    }
    specs = [
        GroupSpec("vision", ToyEncoderFamily(enc), DDPStrategy, StrategyOptions(), 1, 2, optims["vision"]),
        GroupSpec("llm", ToyLMFamily(lm), DDPStrategy, StrategyOptions(), 1, 2, optims["llm"]),
    ]
    ref = ReferenceModel({"vision": ToyEncoderFamily(enc), "llm": ToyLMFamily(lm)}, optims)
    orch = Orchestrator(specs, placement="disaggregated", clip_grad_norm=0.5)
    try:
        nodes = orch.placement()
        assert len(set(nodes["vision"])) == 1 and len(set(nodes["llm"])) == 1, nodes
        assert set(nodes["vision"]).isdisjoint(nodes["llm"]), f"groups share a node: {nodes}"
        for step in range(2):
            samples = toy_samples(4, seed=step)
            want = ref.step(samples, 0.5)
            got = orch.step(put_samples(samples, start=4 * step))
            assert_scalar_close(got.loss, want.loss, f"step {step} loss")
            for m in ("vision", "llm"):
                ref.assert_params_match(m, orch.full_state_dict(m), what=f"{m} ")
        print("OK", nodes)
    finally:
        orch.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
