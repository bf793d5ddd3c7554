"""What crosses groups: shard and gradient refs are top-level arguments (Ray
resolves only those over Ray Direct Transport), each shard object holds
tensors of one device that own exactly their bytes; groups that cannot be
placed or set up stop with a named error instead of waiting forever."""

from __future__ import annotations

import pytest
import ray
import torch

from disagg.builtin.ddp import DDPStrategy
from disagg.interfaces import EmbeddingShard, OptimSpec, StrategyOptions
from disagg.runtime.actor.spec import WorkerSpec
from disagg.runtime.actor.worker import ModuleWorker
from disagg.runtime.groups import GroupSpec, StartTimeout, start_groups
from disagg.runtime.orchestrator import Orchestrator
from disagg.testing.toy import ToyEncoderFamily, ToyLMFamily, make_toy_dirs, put_samples, toy_samples


def _worker() -> ModuleWorker:
    w = ModuleWorker(
        WorkerSpec("vision", 0, 1, 1, 1, None, DDPStrategy, StrategyOptions(), None, "cpu", "fp32", 0)
    )
    full = torch.randn(10, 4, requires_grad=True) * 2  # the encoder's whole output
    shard = EmbeddingShard(torch.arange(3, 7), full[3:7], 10)  # a view into it, as ulysses cuts one
    w.pending[0] = ([5], [shard])
    return w


@pytest.mark.parametrize("host", [True, False])
def test_shard_object_is_one_device_and_owns_its_bytes(host):
    ((positions, value, total),) = _worker().shards_for(0, [5], host).values()
    assert positions.device == value.device and total == 10
    assert torch.equal(positions, torch.arange(3, 7))
    if host:  # the object store would pickle a view's whole storage
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size()
    assert not value.requires_grad and value.is_contiguous()


class _Spy:
    """An actor handle that records the arguments of every submitted call."""

    def __init__(self, actor, calls):
        self._actor, self._calls = actor, calls

    def __getattr__(self, name):
        method = getattr(self._actor, name)
        calls = self._calls

        class _M:
            def __init__(self, m):
                self._m = m

            def options(self, **kw):
                return _M(self._m.options(**kw))

            def remote(self, *args, **kw):
                ref = self._m.remote(*args, **kw)
                calls.append((name, args, ref))
                return ref

        return _M(method)


def _nested_refs(value, top=True):
    if isinstance(value, ray.ObjectRef):
        return [] if top else [value]
    if isinstance(value, (list, tuple)):
        return [r for v in value for r in _nested_refs(v, False)]
    if isinstance(value, dict):
        return [r for v in value.values() for r in _nested_refs(v, False)]
    return []


def test_shard_and_gradient_refs_are_top_level_arguments(ray_local, tmp_path):
    enc, lm = make_toy_dirs(tmp_path)
    optim = OptimSpec(lr=1e-2)
    orch = Orchestrator(
        [
            GroupSpec("vision", ToyEncoderFamily(enc), DDPStrategy, StrategyOptions(), 1, 1, optim),
            GroupSpec("llm", ToyLMFamily(lm), DDPStrategy, StrategyOptions(), 1, 1, optim),
        ],
        microbatches=2,
    )
    calls: list = []
    try:
        for g in orch.groups:
            g.actors = [_Spy(a, calls) for a in g.actors]
        result = orch.step(put_samples(toy_samples(4)))
        assert result.loss > 0
    finally:
        for g in orch.groups:
            g.actors = [a._actor for a in g.actors]
        orch.shutdown()
    made = {name: {ref for n, _, ref in calls if n == name} for name in ("shards_for", "grads_for")}
    assert made["shards_for"] and made["grads_for"]
    for consumer, produced in (("loss_and_backward", "shards_for"), ("backward", "grads_for")):
        passed = [(args, ref) for n, args, ref in calls if n == consumer]
        assert passed
        top = {a for args, _ in passed for a in args if isinstance(a, ray.ObjectRef)}
        nested = {r for args, _ in passed for a in args for r in _nested_refs(a)}
        assert made[produced] <= top, f"{consumer}: some {produced} refs were not top-level arguments"
        assert not (made[produced] & nested), f"{consumer}: {produced} refs nested in a list"


def test_unplaceable_group_stops_with_a_named_timeout(ray_local, tmp_path):
    enc, lm = make_toy_dirs(tmp_path)
    spec = GroupSpec("llm", ToyLMFamily(lm), DDPStrategy, StrategyOptions(), 1, 1, None, num_cpus=1000)
    kw = dict(device="cpu", precision="fp32", seed=0, start_timeout_s=2)
    with pytest.raises(StartTimeout, match=r"'llm'.*not placed within 2 s.*start_timeout_s.*CPU"):
        start_groups([spec], placement="collocated", **kw)
    with pytest.raises(StartTimeout, match=r"module 'llm'.*not placed within 2 s"):
        start_groups([spec], placement="disaggregated", **kw)
    assert ray.util.placement_group_table() and all(
        p["state"] == "REMOVED" for p in ray.util.placement_group_table().values()
    )
