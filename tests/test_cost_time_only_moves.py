"""An invariant of the time model, checked on the code at hand (no recording involved): the
efficiency curve (compute time by GEMM shape, :mod:`disagg.plan.efficiency`) changes step times
and nothing else. Every ``bench --predict`` row's memory, fit and per-group costs (state,
activations, bytes and calls by kind, FLOPs), and every planned layout's memory and costs, equal
the flat model's (every FLOP at the MFU) on the published setting and the tiny model; the compute
seconds do move. The predictions come from ``cost_fixture.dump`` on the recorded tiny config
(computed once per session, shared with ``test_cost_change_detector.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_zero")

from cost_fixture import recorded_and_current  # noqa: E402

#: what a row of ``bench --predict`` or a planned layout states besides time
MACHINE_FREE = ("memory_per_gpu", "fits", "groups", "layout", "recompute", "vision_tokens")


def test_only_time_moves_with_the_gemm_shapes():
    _, now = recorded_and_current()
    flat, shaped = now["bench_predict"]["rows"], now["by_shape"]["bench_predict"]["rows"]
    assert len(flat) == len(shaped)
    for a, b in zip(flat, shaped, strict=True):
        assert {k: a[k] for k in MACHINE_FREE} == {k: b[k] for k in MACHINE_FREE}
    assert any(a["step_time_s"] != b["step_time_s"] for a, b in zip(flat, shaped))
    for a, b in zip(now["bench_predict"]["ratios"], now["by_shape"]["bench_predict"]["ratios"], strict=True):
        assert a["fits"] == b["fits"] and a["vision_tokens"] == b["vision_tokens"]
    # the published plan at 16k: the same layouts with the same memory, fit or not, in another order
    key = lambda r: (r[0], r[2], r[3])  # noqa: E731  (name, memory, fits)
    pub_flat = now["plans"]["published-16384"]["ranking"]
    pub_shaped = now["by_shape"]["plans"]["published-16384"]["ranking"]
    assert sorted(map(key, pub_flat)) == sorted(map(key, pub_shaped))
    assert [r[1] for r in pub_flat] != [r[1] for r in pub_shaped]
    for name in ("uniform_tp", "dhp_ulysses_tp", "uniform_zero3"):
        then = now["plans"]["published-16384"]["summary"]["layouts"][name]
        got = now["by_shape"]["plans"]["published-16384"]["summary"]["layouts"][name]
        if then["name"] == got["name"]:
            assert then["memory_bytes"] == got["memory_bytes"] and then["fits"] == got["fits"]
    # the tiny model on two GPUs: every layout's costs equal, with and without the curve
    tiny = now["by_shape"]["plans"]["tiny-h100x2"]
    assert tiny["shaped"]["layouts"] == tiny["flat"]["layouts"]
    assert sorted(map(key, tiny["shaped"]["ranking"])) == sorted(map(key, tiny["flat"]["ranking"]))
    assert [r[1] for r in tiny["shaped"]["ranking"]] != [r[1] for r in tiny["flat"]["ranking"]]
    # and the compute seconds by shape differ from FLOPs at the flat MFU for the published estimates
    est = [(e, c) for e, c in zip(now["estimates"], now["by_shape"]["compute_s"]) if c is not None]
    moved = [c != e["cost"]["flops"] / (989e12 * 0.4) for e, c in est if e["key"][0] == "published"]
    assert moved and all(moved)
