"""GPUs asked for on a Ray cluster that has none (``train.device: cuda``, or a
``resources.num_gpus``) are refused before any actor starts, naming the key, what
the cluster has and the fix; before, the placement waited ``parallel.start_timeout_s``
(15 minutes by default) for GPUs that never came."""

from __future__ import annotations

import time

import pytest
import yaml

from disagg.testing import toy
from disagg.testing.toy import make_toy_dirs


@pytest.fixture
def toy_registry(disagg_registry):
    from disagg.plugins import register_plugin

    return register_plugin(toy, name="disagg.testing.toy")


@pytest.mark.parametrize(
    "train,parallel,key",
    [
        ({"device": "cuda"}, {}, "train.device"),
        # one whole GPU per rank: disaggregated (collocated shares of 1 leave the other group none)
        (
            {},
            {"placement": "disaggregated", "llm": {"resources": {"num_gpus": 1}}},
            "parallel.llm.resources.num_gpus",
        ),
    ],
)
def test_gpus_on_a_gpu_less_cluster_are_refused_before_any_actor(
    ray_local, toy_registry, tmp_path, monkeypatch, capsys, train, parallel, key
):
    import disagg.runtime.orchestrator as orchestrator
    from disagg.cli.main import main

    if ray_local.cluster_resources().get("GPU", 0):
        pytest.skip("the cluster has GPUs")

    def no_actor(*args, **kwargs):
        raise AssertionError("an actor group was started")

    monkeypatch.setattr(orchestrator, "start_groups", no_actor)
    enc, lm = make_toy_dirs(tmp_path / "models")
    cfg = {
        "model": {"vision": {"family": "toy", "path": str(enc)}, "llm": {"family": "toy", "path": str(lm)}},
        "parallel": parallel,
        "train": {"steps": 1, **train},
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    code = main(["train", str(tmp_path / "c.yaml")])
    took = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert code != 0 and took < 30, (code, took)
    assert f"{key}: " in err and "the Ray cluster has 0 GPUs" in err, err
    assert "train.device: cpu" in err or "remove it" in err, err
