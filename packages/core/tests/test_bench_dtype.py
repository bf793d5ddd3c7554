"""``disagg bench`` with ``train.precision: auto`` picks the dtype from the Ray
cluster's GPUs (where the actors run), not from the driver's device."""

from __future__ import annotations

import ray

import disagg.runtime.run as run
from disagg.cli.bench import _cluster_precision
from disagg.config.schema import Config


def _cfg(device="auto"):
    return Config.model_validate(
        {
            "model": {"vision": {"family": "x", "path": "v"}, "llm": {"family": "x", "path": "l"}},
            "train": {"device": device},
        }
    )


def test_dtype_follows_the_cluster_not_the_driver(monkeypatch):
    seen = {}
    monkeypatch.setattr(run, "ensure_ray", lambda address, n, reserved=0: seen.update(reserved=reserved))
    layouts = {"a": {"vision": {"degree": 2}, "llm": {"degree": 4, "replicas": 2}}, "b": {}}
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 8.0})
    assert _cluster_precision(_cfg(), layouts) == "bf16"  # the driver here has no GPU
    assert seen["reserved"] == 10  # the largest layout: 2 + 8 ranks of 1 CPU
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0})
    assert _cluster_precision(_cfg(), layouts) == "fp32"
    assert _cluster_precision(_cfg("cpu"), {"a": {}}) == "fp32"
