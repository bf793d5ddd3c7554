"""The embedded local Ray keeps logical CPUs to spare beyond the training actors."""

from __future__ import annotations

import pytest

from disagg.runtime import run


@pytest.mark.parametrize("reserved,expected", [(0, 8), (6, 8), (8, 10), (12, 14), (7.5, 10)])
def test_local_ray_leaves_cpus_beyond_the_actors(monkeypatch, reserved, expected):
    # 8 actors on 8 logical CPUs (bench at degree 4) never reached step 1: Ray Data
    # launched no preprocessing task while every CPU was held by an actor.
    calls = []
    monkeypatch.setattr(run.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(run.ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(run.os, "cpu_count", lambda: 2)
    run.ensure_ray(None, None, reserved=reserved)  # CPUs the ranks reserve
    assert calls == [{"num_cpus": expected, "include_dashboard": False}]


def test_an_explicit_num_cpus_wins(monkeypatch):
    calls = []
    monkeypatch.setattr(run.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(run.ray, "init", lambda **kw: calls.append(kw))
    run.ensure_ray(None, 3, reserved=8)
    assert calls[0]["num_cpus"] == 3


@pytest.mark.parametrize("logical,cores,expected", [(16, 16, 14), (8, 2, 2), (8, 16, 6), (2, 2, 1)])
def test_a_plan_on_local_ray_leaves_cpus_to_ray_data(monkeypatch, logical, cores, expected):
    """``disagg plan --ray`` and ``parallel.auto`` size the CPU cluster from Ray:
    as many ranks as cores, never every logical CPU (the same deadlock)."""
    import ray

    from disagg.plan import cluster

    node = {"Alive": True, "Resources": {"CPU": float(logical), "memory": 8 * 2**30}}
    monkeypatch.setattr(ray, "nodes", lambda: [node])
    monkeypatch.setattr(cluster.os, "cpu_count", lambda: cores)
    assert cluster.cluster_from("cpu", ray_cluster=True).devices_per_node == expected
