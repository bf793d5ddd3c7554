"""``resources.num_gpus`` per placement, refused before any actor starts with
the key named: fractions under disaggregated, shares past one GPU under
collocated, 0 on CUDA; and the default split of what explicit shares leave."""

from __future__ import annotations

import pytest

from disagg.builtin.ddp import DDPStrategy
from disagg.config.errors import ConfigError
from disagg.config.schema import Config
from disagg.config.validate import validate
from disagg.interfaces import StrategyOptions
from disagg.plugins import register_plugin
from disagg.runtime.groups import GroupSpec, _gpus_per_rank
from disagg.runtime.plan import make_plan
from disagg.testing import toy
from disagg.testing.toy import make_toy_dirs


@pytest.fixture
def reg(disagg_registry):
    return register_plugin(toy, name="disagg.testing.toy")


def _cfg(tmp_path, placement, vision_gpus=None, llm_gpus=None, device="cuda", llm_replicas=1):
    enc, lm = make_toy_dirs(tmp_path)
    res = lambda n: {} if n is None else {"resources": {"num_gpus": n}}  # noqa: E731
    return Config.model_validate(
        {
            "model": {
                "vision": {"family": "toy", "path": str(enc)},
                "llm": {"family": "toy", "path": str(lm)},
            },
            "parallel": {
                "placement": placement,
                "vision": res(vision_gpus),
                "llm": {**res(llm_gpus), "replicas": llm_replicas},
            },
            "train": {"device": device},
            "output_dir": str(tmp_path / "run"),
        }
    )


def _problems(cfg, reg) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        validate(cfg, reg)
    return {p.key: p.message for p in err.value.problems}


def test_fraction_under_disaggregated_is_refused(reg, tmp_path):
    got = _problems(_cfg(tmp_path, "disaggregated", vision_gpus=0.5), reg)
    assert list(got) == ["parallel.vision.resources.num_gpus"]
    assert "0.5 is a fraction" in got["parallel.vision.resources.num_gpus"]
    assert "duplicate GPU" in got["parallel.vision.resources.num_gpus"]


def test_collocated_shares_past_one_gpu_are_refused_naming_both_keys(reg, tmp_path):
    got = _problems(_cfg(tmp_path, "collocated", vision_gpus=0.7, llm_gpus=0.5), reg)
    msg = got["parallel.vision.resources.num_gpus"]
    assert "parallel.vision.resources.num_gpus=0.7 + parallel.llm.resources.num_gpus=0.5 = 1.2" in msg
    assert "never be placed" in msg


def test_collocated_full_share_leaves_nothing_for_the_default(reg, tmp_path):
    got = _problems(_cfg(tmp_path, "collocated", vision_gpus=1.0), reg)
    assert "leaving nothing for llm" in got["parallel.vision.resources.num_gpus"]


def test_collocated_share_over_one_is_refused(reg, tmp_path):
    got = _problems(_cfg(tmp_path, "collocated", llm_gpus=2), reg)
    assert "at most 1" in got["parallel.llm.resources.num_gpus"]


def test_zero_gpus_on_cuda_is_refused_once_the_device_is_known(reg, tmp_path):
    got = _problems(_cfg(tmp_path, "disaggregated", llm_gpus=0), reg)
    assert "outside Ray's GPU accounting" in got["parallel.llm.resources.num_gpus"]
    auto = _cfg(tmp_path, "disaggregated", llm_gpus=0, device="auto")
    validate(auto, reg)  # the device is not known yet
    assert make_plan(validate(auto, reg), reg, cluster_gpus=0).device == "cpu"  # on CPU the share is unused
    with pytest.raises(ConfigError, match=r"parallel.llm.resources.num_gpus: 0 on CUDA"):
        make_plan(validate(auto, reg), reg, cluster_gpus=2)


def test_valid_shares_pass_and_the_default_splits_what_is_left(reg, tmp_path):
    cfg = _cfg(tmp_path, "collocated", vision_gpus=0.25, llm_replicas=2)
    plan = make_plan(validate(cfg, reg), reg, cluster_gpus=2)
    specs = plan.specs
    # GPU 0: vision 0.25, llm rank 0 takes the 0.75 left; GPU 1: llm rank 1 alone
    assert _gpus_per_rank(specs[1], specs, "collocated", 0) == pytest.approx(0.75)
    assert _gpus_per_rank(specs[1], specs, "collocated", 1) == pytest.approx(1.0)
    even = [GroupSpec(m, None, DDPStrategy, StrategyOptions(), 1, 1, None) for m in ("vision", "llm")]
    assert _gpus_per_rank(even[0], even, "collocated", 0) == 0.5
    assert _gpus_per_rank(even[0], even, "disaggregated", 0) == 1.0
    validate(_cfg(tmp_path, "disaggregated", vision_gpus=1, llm_gpus=2), reg)
