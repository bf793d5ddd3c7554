"""``disagg plan`` on the published setting: Qwen2.5-VL-32B config values, 8 x
H100 (80 GB), the paper's vision lengths. The plan must put TP 8 on the LLM, prefer Ulysses SP
for the vision encoder over uniform TP and over ZeRO-3 (first at 32k; at 16k within 1% of a
data-parallel ZeRO-1 tower, see below),
predict ZeRO-3 out of memory at 16k vision tokens (where the paper saw it), and
predict DHP faster than uniform TP by the step times docs/benchmarks.md records (1.08x
at 16k and 32k), which is below the paper's measured 1.26-1.37x (the page
says why). Pure computation from each strategy's cost hook."""

from __future__ import annotations

import pytest

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_zero")


@pytest.fixture(scope="module")
def results():
    from disagg.plan.published import plan_published
    from disagg.plugins import get_registry

    return {n: plan_published(n, get_registry()) for n in (16 * 1024, 32 * 1024)}


#: uniform TP and DHP predicted step seconds, as docs/benchmarks.md records them
RECORDED_STEP_S = {16 * 1024: (4.549, 4.219), 32 * 1024: (8.895, 8.25)}


@pytest.mark.parametrize("n", [16 * 1024, 32 * 1024])
def test_plan_prefers_ulysses_vision_with_tp_llm(results, n):
    from disagg.plan.published import named, summary

    result = results[n]
    best = result.best
    assert best.groups["llm"].strategy == "megatron_tp"
    assert best.groups["llm"].degree == 8  # the 32B LLM's state only fits split 8 ways
    ulysses = next(x for x in result.ranked if x.groups["vision"].strategy == "ulysses")
    assert ulysses.groups["llm"].strategy == "megatron_tp"
    if n == 32 * 1024:
        assert best is ulysses
    else:
        # Since the loss holds one 1,024-token chunk of logits instead of the whole microbatch's
        # (parallel.llm.loss_chunk_tokens), a data-parallel ZeRO-1 tower beside TP 8 also fits in
        # the collocated GPUs at 16k (71.8 of 74.5 GiB) and is predicted 0.8% faster than ulysses
        # (4.138 vs 4.173 s): at 16k the tower's replicas cost less than its all-to-alls.
        assert best.groups["vision"].strategy == "zero"
        assert ulysses.step_time_s <= 1.01 * best.step_time_s
    tp, dhp, z3 = (named(result, k) for k in ("uniform_tp", "dhp_ulysses_tp", "uniform_zero3"))
    assert tp.fits and dhp.fits and not z3.fits
    assert result.ranked.index(dhp) < result.ranked.index(tp)
    assert z3 in result.oom
    # where DHP wins: the vision group's collectives (TP all-reduces every block's activations)
    assert (
        sum(dhp.costs["vision"].comm_bytes_by_kind.values())
        < sum(tp.costs["vision"].comm_bytes_by_kind.values()) / 5
    )
    from disagg.bench.published import PAPER

    s = summary(result)
    assert (round(tp.step_time_s, 3), round(dhp.step_time_s, 3)) == RECORDED_STEP_S[n]
    assert s["speedup_dhp_vs_tp"] == pytest.approx(tp.step_time_s / dhp.step_time_s)
    assert round(s["speedup_dhp_vs_tp"], 2) == 1.08 < PAPER["throughput_dhp_vs_tp"][0]


def test_zero3_runs_out_of_memory_where_the_paper_saw_it(results):
    from disagg.bench.published import PAPER
    from disagg.plan.published import named

    z3 = named(results[PAPER["zero3_oom_vision_tokens"]], "uniform_zero3")
    assert not z3.fits and z3.memory_bytes > PAPER["gpu_memory_bytes"]
