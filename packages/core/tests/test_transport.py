"""Transport selection: object store on CPU; the gloo direct transport is
refused before any actor starts, with the reason."""

from __future__ import annotations

import pytest

from disagg.config.errors import ConfigError
from disagg.config.schema import Config
from disagg.config.validate import validate
from disagg.plugins import register_plugin
from disagg.runtime.plan import make_plan
from disagg.testing import toy
from disagg.testing.toy import make_toy_dirs


def _cfg(tmp_path, transport):
    enc, lm = make_toy_dirs(tmp_path)
    return Config.model_validate(
        {
            "model": {
                "vision": {"family": "toy", "path": str(enc)},
                "llm": {"family": "toy", "path": str(lm)},
            },
            "parallel": {"transport": transport},
            "output_dir": str(tmp_path / "run"),
        }
    )


def test_auto_transport_is_object_store_on_cpu_and_nccl_on_cuda(disagg_registry, tmp_path):
    reg = register_plugin(toy, name="disagg.testing.toy")
    cfg = _cfg(tmp_path, "auto")
    assert make_plan(cfg, reg, cluster_gpus=0).transport.name == "object_store"
    plan = make_plan(cfg, reg, cluster_gpus=8)
    assert plan.transport.name == "nccl" and plan.dtype == "bfloat16" and plan.device == "cuda"


def test_gloo_direct_transport_is_refused_with_reason(disagg_registry, tmp_path):
    reg = register_plugin(toy, name="disagg.testing.toy")
    with pytest.raises(
        ConfigError, match=r"parallel.transport.*default torch.distributed group.*object_store"
    ):
        validate(_cfg(tmp_path, "gloo"), reg)
