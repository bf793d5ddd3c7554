"""The published setting's longest trainable vision sequence per layout and precision recipe
(``disagg.bench.published_fit``: Qwen2.5-VL-32B on 8 x 80 GB, recompute: full), checked against
what can be computed without the model: the search returns a length that fits and a next step
that does not, the reason it prints names the LLM's state at the bytes counted from the parameter
count (18 B per parameter under ``bf16`` over 8 ranks: 73.7 GB), ``bf16-pure`` holds under 0.45 of
``bf16``'s state (8 B against 18), and ZeRO-3 runs out of memory at 16k (where the paper saw it)
because its LLM state alone is 18 B per parameter over 8 ranks. A recipe a layout's strategy does
not honour (``Strategy.precisions``) is not predicted: the cell says so, naming the strategy.

The project's goals (DHP+SP at 64k under ``bf16``, 128k under ``bf16-pure``, DHP ahead of TP) are
not asserted here: they are the model's own output, printed met / not met for the record by
``python -m disagg.bench.published`` (``fit_goal_lines``). Pure computation."""

from __future__ import annotations

import pytest

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_zero")

GB80 = 80 * 10**9


@pytest.fixture(scope="module")
def strategies():
    from disagg.plugins import get_registry

    return get_registry().strategies


def _honours(strategies, layout, precision):
    return all(precision in strategies[g["strategy"]].precisions for g in layout.values())


def _llm_params():
    from disagg.bench.published import QWEN2_5_VL_32B
    from disagg.plan.published import published_shapes

    return sum(t.numel for t in published_shapes(QWEN2_5_VL_32B)["llm"].tensors())


def test_dhp_sp_longest_fit_is_the_edge_and_its_reason_is_the_llm_state(strategies):
    from disagg.bench.published_fit import FIT_LAYOUTS, STEP, longest_fit, memory

    fit = longest_fit("dhp_sp", "bf16", GB80, strategies)
    assert fit.longest and fit.memory_bytes <= GB80
    # the search's edge, recomputed here: the length found fits, one step more does not
    assert memory(FIT_LAYOUTS["dhp_sp"], fit.longest, "bf16", strategies)[0] <= GB80
    over, costs = memory(FIT_LAYOUTS["dhp_sp"], fit.longest + STEP, "bf16", strategies)
    assert over > GB80
    # the next step is over, and the reason names its largest term, the 32B LLM's state, at the
    # bytes the parameter count gives: 18 B per parameter (bf16 weight, fp32 master, gradient and
    # two moments) over 8 TP ranks, plus what TP keeps whole on every rank (norms: < 0.1%)
    assert "next step" in fit.reason and "llm state" in fit.reason
    independent = 18 * _llm_params() / 8
    assert costs["llm"].state_bytes == pytest.approx(independent, rel=1e-3)
    assert f"llm state {independent / 1e9:.1f} GB" in fit.reason, fit.reason


def test_bf16_pure_holds_under_half_the_bf16_state(strategies):
    from disagg.bench.published_fit import FIT_LAYOUTS, longest_fit, memory

    layout = FIT_LAYOUTS["dhp_sp"]
    costs = memory(layout, 128 * 1024, "bf16-pure", strategies)[1]
    # 8 bytes per parameter (bf16 weight, gradient, moments) where bf16 holds 18
    bf16 = memory(layout, 128 * 1024, "bf16", strategies)[1]
    assert costs["llm"].state_bytes < 0.45 * bf16["llm"].state_bytes
    assert costs["llm"].state_bytes == pytest.approx(8 * _llm_params() / 8, rel=1e-3)
    fit = longest_fit("dhp_sp", "bf16-pure", GB80, strategies)
    if _honours(strategies, layout, "bf16-pure"):
        assert fit.longest is not None and fit.memory_bytes <= GB80, fit
    else:  # the table predicts only what training does
        assert fit.longest is None and "does not honour train.precision bf16-pure" in fit.reason, fit


def test_zero3_runs_out_of_memory_at_16k_for_the_reason_printed(strategies):
    """``zero`` honours ``bf16`` (DeepSpeed's bf16 mode), so the paper's bf16 ZeRO-3 row is
    predicted: out of memory at 16k, and at every length, because of what the model prints
    first, the 32B LLM's ZeRO-3 state (18 bytes per parameter over 8 ranks)."""
    from disagg.bench.published import QWEN2_5_VL_32B
    from disagg.bench.published_fit import FIT_LAYOUTS, longest_fit, memory, terms
    from disagg.plan.published import published_shapes

    layout = FIT_LAYOUTS["zero3"]
    assert _honours(strategies, layout, "bf16") and _honours(strategies, layout, "fp32")
    total, costs = memory(layout, 16 * 1024, "bf16", strategies)
    assert total > GB80
    llm = published_shapes(QWEN2_5_VL_32B)["llm"]
    params = sum(t.numel for t in llm.tensors())
    # DeepSpeed's stage 3 under bf16: bf16 partition 2 + fp32 master 4 + fp32 gradient 4 + moments 8
    assert costs["llm"].state_bytes == pytest.approx(18 * params / 8, rel=1e-3)
    assert terms(costs)[0][0] == "llm state"
    assert costs["llm"].state_bytes > 0.9 * GB80  # alone nearly the whole GPU: no length fits
    for precision in ("fp32", "bf16"):
        fit = longest_fit("zero3", precision, GB80, strategies)
        assert fit.longest is not None and fit.longest < 16 * 1024, fit
        # the reason the table prints is the code's: the layout's largest memory terms
        largest, value = terms(fit.costs)[0]
        assert "out of memory" in fit.reason or "next step" in fit.reason, fit
        assert f"{largest} {value / 1e9:.1f} GB" in fit.reason, (largest, fit.reason)
        assert largest == "llm state", fit.reason
    bf16 = longest_fit("zero3", "bf16", GB80, strategies)
    assert bf16.longest == 0 and bf16.reason.startswith("out of memory at 1k"), bf16


def test_the_table_prints_every_layout_and_recipe(strategies):
    from disagg.bench.published import PAPER
    from disagg.bench.published_fit import FIT_LAYOUTS, FIT_RECIPES, Fit, fit_md

    fits = [Fit(n, p, 2048, 1, "r") for n in FIT_LAYOUTS for p in FIT_RECIPES]
    md = fit_md(fits, GB80, PAPER)
    for name in FIT_LAYOUTS:
        assert f"| {name} | " + " | ".join(["2k (0.0 GB)"] * len(FIT_RECIPES)) + " |" in md


def test_the_goals_are_printed_met_or_not():
    """The goals are stated in the bench's output for the record, whichever way they fall."""
    from disagg.bench.published_fit import Fit, fit_goal_lines

    lines = fit_goal_lines([Fit("dhp_sp", "bf16", 70 * 1024), Fit("dhp_sp", "bf16-pure", 100 * 1024)], 0.9)
    assert lines == [
        "goal: dhp_sp fits 64k vision tokens under `bf16` (usable 0.90): met (predicted 70k)",
        "goal: dhp_sp fits 128k vision tokens under `bf16-pure` (usable 0.90): not met (predicted 100k)",
    ]
