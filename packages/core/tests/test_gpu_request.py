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


def test_an_embedded_ray_waits_briefly_for_placement(monkeypatch):
    """The Ray a run starts itself cannot grow: its groups wait 30 s to be placed, not
    ``parallel.start_timeout_s`` (which still bounds their set-up); a joined cluster may
    grow (an autoscaler), so there the placement waits the whole timeout."""
    from types import SimpleNamespace

    import disagg.runtime.run as run
    from disagg.config.schema import Config

    cfg = Config.model_validate({"model": {"llm": {"family": "toy", "path": "/x"}}})
    plan = SimpleNamespace(specs=[], device="cpu", precision="fp32", transport=None)
    registry = SimpleNamespace(schedules={cfg.train.schedule: lambda: None})
    got: dict = {}
    monkeypatch.setattr(run, "Orchestrator", lambda specs, **kw: got.update(kw))
    for embedded, placement in ((True, run.EMBEDDED_PLACEMENT_S), (False, None)):
        monkeypatch.setattr(run, "_EMBEDDED", embedded)
        run._start_groups(cfg, plan, registry)  # type: ignore[arg-type]
        assert (got["placement_timeout_s"], got["start_timeout_s"]) == (placement, 900.0)
    assert run.EMBEDDED_PLACEMENT_S == 30.0
