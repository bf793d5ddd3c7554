"""The like-for-like comparison's bookkeeping (``disagg.bench.published_compare``) on layouts made
by hand, so every expected figure is known without the model: which layouts are homogeneous, that
the best homogeneous layout is the fastest one that fits under the usable fraction, that a layout
that does not fit is shown as not fitting and never enters a ratio, that both sides share the
recompute and offload, and that the split adds up to the step. Pure computation, no search."""

from __future__ import annotations

import pytest

from disagg.interfaces import Cost
from disagg.plan.cluster import PRESETS
from disagg.plan.model import Group, Layout, Workload
from disagg.plan.search import PlanResult

GB = 10**9


def _layout(vision, llm, seconds, memory_gb):
    """``vision`` / ``llm``: (strategy, degree, replicas, options); ``seconds``: (vision, llm) compute."""
    groups = {
        m: Group(m, s, d, r, tuple(sorted(o.items())))
        for m, (s, d, r, o) in (("vision", vision), ("llm", llm))
    }
    x = Layout(groups=groups, placement="collocated", microbatches=1, schedule="sequential")
    half = memory_gb * GB // 2
    x.costs = {
        m: Cost(state_bytes=half, activation_bytes=0, comm_bytes_by_kind={}, sent_bytes=0, flops=0)
        for m in groups
    }
    x.times = {
        m: {"compute_s": s, "collective_s": 0.5, "overhead_s": 0.0, "transfer_s": 0.0}
        for m, s in zip(groups, seconds)
    }
    x.step_time_s = sum(sum(t.values()) for t in x.times.values())
    x.memory_bytes = memory_gb * GB
    return x


FULL = {"recompute": "full"}
TP = ("megatron_tp", 8, 1, FULL)
TP_SP = ("megatron_tp", 8, 1, {**FULL, "sequence_parallel": True})
ZERO3 = ("zero", 1, 8, {**FULL, "stage": 3})
ZERO3_OFFLOAD = ("zero", 1, 8, {**FULL, "stage": 3, "offload_optimizer": True})
ULY = ("ulysses", 8, 1, FULL)


@pytest.fixture
def result():
    layouts = [
        _layout(TP, TP, (2.0, 6.0), 78),  # 9.0 s, fits 80 GB, not 72
        _layout(TP_SP, TP_SP, (1.5, 5.0), 70),  # 7.5 s, fits both
        _layout(ZERO3, ZERO3, (0.5, 1.0), 90),  # 2.5 s: fastest, fits neither
        _layout(ZERO3_OFFLOAD, ZERO3_OFFLOAD, (0.1, 0.1), 10),  # offload: not like for like
        _layout(("ddp", 1, 8, {}), ("ddp", 1, 8, {}), (0.1, 0.1), 10),  # no recompute: not like for like
        _layout(ULY, TP, (1.0, 5.0), 71),  # 7.0 s, DHP: fits both
        _layout(ULY, TP_SP, (0.5, 5.0), 85),  # 6.5 s, DHP+SP: fits neither
        _layout(TP, TP_SP, (1.0, 1.0), 10),  # neither homogeneous nor DHP
    ]
    work = Workload(shapes={}, vision_tokens=65536, text_tokens=512, samples=8)
    return PlanResult(PRESETS["h100x8"], work, [], layouts)


def test_families_and_like_for_like():
    from disagg.bench.published_compare import comparable, family

    assert family(_layout(TP, TP, (1, 1), 1)) == "uniform_tp"
    assert family(_layout(TP_SP, TP_SP, (1, 1), 1)) == "uniform_tp_sp"
    assert family(_layout(ZERO3, ZERO3, (1, 1), 1)) == "uniform_zero3"
    assert family(_layout(ULY, TP_SP, (1, 1), 1)) == "dhp_sp"
    assert family(_layout(TP, TP_SP, (1, 1), 1)) is None
    assert not comparable(_layout(ZERO3_OFFLOAD, ZERO3_OFFLOAD, (1, 1), 1))
    assert not comparable(_layout(("ddp", 1, 8, {}), ("ddp", 1, 8, {}), (1, 1), 1))


@pytest.mark.parametrize(
    ("usable", "best", "best_s"), [(1.0, "uniform_tp_sp", 7.5), (0.9, "uniform_tp_sp", 7.5)]
)
def test_best_homogeneous_is_the_fastest_that_fits_and_oom_never_enters_a_ratio(result, usable, best, best_s):
    from disagg.bench.published_compare import compare, refit

    t = compare(refit(result, usable), "bf16", usable)
    assert t["usable"] == usable and t["budget_bytes"] == int(80 * GB * usable)
    assert (
        t["best_homogeneous"] == best
    )  # ZeRO-3 is faster but does not fit; offload and no-recompute are out
    rows = {r["row"]: r for r in t["rows"]}
    assert set(rows) == {
        "uniform_tp",
        "uniform_tp_sp",
        "uniform_zero3",
        *("dhp_ulysses8_tp8", "dhp_ulysses8_tp8_sp", "dhp_tp_cp", "dhp_fsdp_cp", "dhp_best"),
    }
    # no context-parallel layout was searched here: those rows say so and enter no ratio
    assert rows["dhp_tp_cp"]["layout"] is None and rows["dhp_tp_cp"]["stopped_by"] == "not searched"
    assert (
        rows["uniform_zero3"]["fits"] is False and "memory 90.0 GB >" in rows["uniform_zero3"]["stopped_by"]
    )
    assert rows["uniform_tp"]["fits"] is (usable == 1.0)
    assert (
        rows["dhp_ulysses8_tp8_sp"]["fits"] is False
        and rows["dhp_ulysses8_tp8_sp"]["vs_best_homogeneous"] is None
    )
    # DHP (7.0 s, 71 GB) fits both budgets: 7.5 / 7.0
    assert rows["dhp_ulysses8_tp8"]["vs_best_homogeneous"] == pytest.approx(best_s / 7.0)
    assert t["dhp_vs_best_homogeneous"] == pytest.approx(best_s / 7.0)
    for r in rows.values():
        assert r["recompute"] == "full" and r["offload"] == "none" and r["usable"] == usable
        if r["layout"] is None:
            continue
        assert sum(sum(v.values()) for v in r["split"].values()) == pytest.approx(r["step_time_s"])
    # the ceiling if DHP's tower took no time: 7.5 / (5.0 + 0.5)
    assert t["ceiling_if_vision_free"] == pytest.approx(7.5 / 5.5)


def test_no_ratio_when_no_homogeneous_layout_fits(result):
    from disagg.bench.published_compare import compare, compare_md, refit

    t = compare(refit(result, 0.5), "bf16", 0.5)  # 40 GB: only the excluded ones would fit
    assert t["best_homogeneous"] is None and t["dhp_vs_best_homogeneous"] is None
    assert all(r.get("vs_best_homogeneous") is None for r in t["rows"])
    md = compare_md(t)
    assert "usable 0.50 (40.0 GB per GPU)" in md and "none fits" in md


def test_json_rows_state_layout_recipe_offload_usable_and_stop(result, monkeypatch, capsys):
    import json

    from disagg.bench import published, published_compare

    def fake_run(lengths, precisions, usables, cluster=None):
        assert (lengths, precisions, usables) == ([65536], ["bf16"], [0.9, 1.0])
        return {
            "tables": [
                published_compare.compare(published_compare.refit(result, u), "bf16", u) for u in usables
            ],
            "paper": [],
        }

    from disagg.bench import published_fit

    def fake_fits(budget, strategies=None, precisions=published_fit.FIT_RECIPES, layouts=None):
        return [
            published_fit.Fit("dhp_sp", p, 2048, budget // 2, "r", stopped_by="llm state") for p in precisions
        ]

    monkeypatch.setattr(published_compare, "run", fake_run)
    monkeypatch.setattr(published_fit, "fit_table", fake_fits)
    assert published.main(["64k", "--usable", "0.9,1.0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # the longest-fit table, machine-readable: each row its layout, recipe, offload, usable and stop
    assert {(f["recipe"], f["offload"], f["usable"]) for f in out["fits"]} == {
        (r, o, u)
        for r, o in (
            ("fp32", "none"),
            ("bf16", "none"),
            ("bf16", "optimizer"),
            ("bf16", "all"),
            ("bf16-pure", "none"),
            ("bf16-pure", "optimizer"),
            ("bf16-pure", "all"),
        )
        for u in (0.9, 1.0)
    }
    for f in out["fits"]:
        assert f["layout"] == "dhp_sp" and f["stopped_by"] == "llm state" and f["parallel"]
    assert [t["usable"] for t in out["tables"]] == [0.9, 1.0]
    for t in out["tables"]:
        for r in t["rows"]:
            assert {"layout", "precision", "offload", "usable", "stopped_by", "recompute"} <= set(r)
            assert r["usable"] == t["usable"]


def test_bad_usable_is_refused_before_any_search(monkeypatch):
    from disagg.bench import published, published_compare

    monkeypatch.setattr(published_compare, "run", lambda *a, **k: pytest.fail("searched"))
    with pytest.raises(ValueError, match=r"--usable 1.5: a fraction of device memory in \(0, 1\]"):
        published.main(["64k", "--usable", "1.5"])
