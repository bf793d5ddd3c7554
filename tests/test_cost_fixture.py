"""Predictions before and after the cost formulas moved into the plugins are equal:
the first-party strategies' ``estimate`` on a grid of queries, ``disagg bench
--predict``'s rows and ``disagg plan``'s whole ranking, on the published
Qwen2.5-VL-32B and the tiny Qwen2.5-VL, exactly as ``data/cost_predictions.json.gz``
recorded them before (``cost_fixture.py`` wrote it)."""

from __future__ import annotations

import gzip
import json

import pytest

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_zero")

from cost_fixture import FIXTURE, dump  # noqa: E402


def test_predictions_equal_the_recorded_ones():
    recorded = json.loads(gzip.decompress(FIXTURE.read_bytes()))
    now = json.loads(json.dumps(dump(recorded["tiny_config"]), sort_keys=True))
    for e_now, e_then in zip(now["estimates"], recorded["estimates"], strict=True):
        assert e_now == e_then, f"estimate {e_then['key']}"
    assert now["bench_predict"] == recorded["bench_predict"]
    for name, then in recorded["plans"].items():
        for x_now, x_then in zip(now["plans"][name]["ranking"], then["ranking"], strict=True):
            assert x_now == x_then, f"plan {name}"
        assert now["plans"][name] == then
