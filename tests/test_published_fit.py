"""The published setting's longest trainable vision sequence per layout and precision recipe
(``disagg.bench.published_fit``: Qwen2.5-VL-32B on 8 x 80 GB, recompute: full, like for like):
DHP with sequence parallelism (ulysses 8 with ``shard: parameters`` + TP 8 with sequence
parallelism) fits 64k vision tokens under ``bf16`` and 128k under ``bf16-pure``, each DHP layout
fits longer than its uniform-TP counterpart, and ZeRO-3 runs out of memory at 16k (in ``fp32``
and, predicted since ``zero`` honours it, ``bf16``) for the reason the table prints: the LLM's
state. A recipe a layout's strategy does not honour (``Strategy.precisions``) is not predicted
in the table: the cell says so, naming the strategy. Pure computation."""

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


def test_dhp_sp_fits_64k_under_bf16_and_beats_tp_like_for_like(strategies):
    from disagg.bench.published_fit import longest_fit

    fit = {n: longest_fit(n, "bf16", GB80, strategies) for n in ("dhp_sp", "tp_sp", "dhp", "tp")}
    assert fit["dhp_sp"].longest >= 64 * 1024, fit["dhp_sp"]
    assert fit["dhp_sp"].memory_bytes <= GB80
    assert fit["dhp_sp"].longest > fit["tp_sp"].longest and fit["dhp"].longest > fit["tp"].longest
    # the next step is over, and the reason names its largest terms (the 32B LLM's state first)
    assert "next step" in fit["dhp_sp"].reason and "llm state" in fit["dhp_sp"].reason


def test_dhp_sp_fits_128k_under_bf16_pure(strategies):
    from disagg.bench.published_fit import FIT_LAYOUTS, longest_fit, memory

    layout = FIT_LAYOUTS["dhp_sp"]
    total, costs = memory(layout, 128 * 1024, "bf16-pure", strategies)
    assert total <= GB80, total  # what the cost model says of the recipe
    # 8 bytes per parameter (bf16 weight, gradient, moments) where bf16 holds 18
    bf16 = memory(layout, 128 * 1024, "bf16", strategies)[1]
    assert costs["llm"].state_bytes < 0.45 * bf16["llm"].state_bytes
    fit = longest_fit("dhp_sp", "bf16-pure", GB80, strategies)
    if _honours(strategies, layout, "bf16-pure"):
        assert fit.longest >= 128 * 1024, fit
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
