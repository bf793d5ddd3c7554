"""megatron_tp with sequence parallelism and the chunked loss (``parallel.llm.loss_chunk_tokens``):
the LLM group's predicted collective bytes and calls by kind and its saved-activation bytes equal
what ``disagg bench`` measured (``examples/bench/results/d2_deep/bench.json``: the tiny Qwen2.5-VL,
ulysses 2 + TP 2 with sequence parallelism, 2 samples of one image in 2 microbatches, fp32, at 256,
1k and 4k vision tokens: one loss chunk at 256 and 1k, two at 4k). Before, the model counted one
all-gather per microbatch too many (the output layer's input re-gathered in backward, which the
chunked loss keeps whole instead: 30 vs 28 calls) and two fp32 logits copies over every token
where the loss saves one over the shifted rows (LLM bytes 2.7-3.6% and activations 7% over)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

BENCH = Path(__file__).resolve().parents[1] / "examples" / "bench" / "results" / "d2_deep" / "bench.json"


def test_tp_sp_llm_bytes_calls_and_activations_equal_the_measured_ones():
    import gzip

    from cost_fixture import FIXTURE

    from disagg.cost import predict
    from disagg.cost.shapes import shapes_for

    # the tiny Qwen2.5-VL's config.json as the cost fixture recorded it: the deep tower's LLM is its
    cfg = json.loads(gzip.decompress(FIXTURE.read_bytes()))["tiny_config"]
    shapes = shapes_for({"vision": cfg, "llm": cfg}, {"vision": "qwen2_5_vl", "llm": "qwen2_5_vl"})
    bench = json.loads(BENCH.read_text())
    samples = bench["config"]["samples_per_step"]
    checked = 0
    for point in bench["points"]:
        if point["layout"] != "dhp_ulysses_tp_sp":
            continue
        layout = bench["layouts"][point["layout"]]["llm"]
        measured = point["measured"]["groups"]["llm"]
        n = point["measured"]["tokens_per_step"] // samples
        cost = predict(
            shapes["llm"],
            "megatron_tp",
            layout["degree"],
            1,
            n,
            "fp32",
            samples=samples,
            microbatches=samples,
            exchanged_rows=point["vision_tokens"] // shapes["vision"].unit,
            exchanged_width=shapes["vision"].out_hidden,
            options={"sequence_parallel": True},
        )
        key = (point["vision_tokens"], n)
        assert cost.comm_bytes_by_kind == measured["collective_bytes_per_rank"], key
        assert cost.comm_calls_by_kind == measured["collective_calls_per_rank"], key
        assert cost.activation_bytes == measured["activation_bytes_per_rank"], key
        assert cost.sent_bytes == measured["sent_bytes_per_rank"], key
        assert cost.state_bytes == measured["state_bytes_per_rank"], key
        checked += 1
    assert checked == 3
