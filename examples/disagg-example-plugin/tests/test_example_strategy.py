"""``example_ddp`` implements only ``parallelize`` to train (and declares ``max_degree``):
everything else is the base ``Strategy``'s. Trained on two gloo ranks with an
uneven split and two microbatches, it equals ``ddp`` exactly and the
single-process model by the project's tolerance policy."""

from __future__ import annotations

import inspect

import example_steps as S
import torch

import disagg_example_plugin.plugin as example
from disagg.kit import Strategy
from disagg.testing.dist import run_ranks
from disagg.testing.reference import ReferenceModel
from disagg.testing.tolerance import assert_exact, assert_scalar_close
from disagg.testing.toy import ToyEncoderFamily, ToyLMFamily, make_toy_dirs

WORLD = 2


def test_example_strategy_writes_only_parallelize() -> None:
    """The methods a new full-replica strategy must write to train: the one
    abstract one (``estimate`` is its optional cost hook, for ``disagg plan``)."""
    assert Strategy.__abstractmethods__ == {"parallelize"}
    own = {
        name
        for name, value in vars(example.ExampleDDP).items()
        if inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod))
    }
    assert own - {"estimate", "option_variants"} == {"parallelize"}, own


def test_example_strategy_trains_and_equals_ddp(disagg_registry, tmp_path) -> None:
    dirs = make_toy_dirs(tmp_path)
    ddp_cls = disagg_registry.strategies["ddp"]  # core's built-in, as a plugin author gets it
    # both strategies in the same two processes, one after the other (one spawn)
    runs = run_ranks(S.train, WORLD, WORLD, *dirs, [example.ExampleDDP, ddp_cls])
    got, ddp = ([S.load(r[k]) for r in runs] for k in range(2))
    ref = ReferenceModel({"vision": ToyEncoderFamily(dirs[0]), "llm": ToyLMFamily(dirs[1])}, S.OPTIMS)
    initial = {m: {k: v.clone() for k, v in mod.state_dict().items()} for m, mod in ref.modules.items()}
    for step, samples in enumerate(S.batches()):
        want = ref.step(samples, S.CLIP)
        loss = sum(r["loss_sum"][step] for r in got) / S.label_count(samples)
        assert loss == sum(r["loss_sum"][step] for r in ddp) / S.label_count(samples)
        assert_scalar_close(loss, want.loss, f"step {step} loss")
        for rank in range(WORLD):
            assert got[rank]["norm"][step] == ddp[rank]["norm"][step]
            assert_scalar_close(got[rank]["norm"][step], want.grad_norm, f"step {step} rank {rank} grad norm")
            for m in ("vision", "llm"):
                params = got[rank]["params"][step][m]
                assert_exact(
                    params, ddp[rank]["params"][step][m], what=f"step {step} rank {rank} {m} vs ddp "
                )
                ref.assert_params_match(m, params, what=f"step {step} rank {rank} {m} param ")
    for m in ("vision", "llm"):  # it trained: every module moved
        last = got[0]["params"][-1][m]
        assert any(not torch.equal(v, initial[m][k]) for k, v in last.items()), m
