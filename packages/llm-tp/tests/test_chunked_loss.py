"""The loss over chunks of tokens (``parallel.llm.loss_chunk_tokens``) equals the loss over the
whole logits: ``ddp`` and ``megatron_tp`` (degree 2, with and without sequence parallelism) on
ragged samples with 0, 2 or 4 image rows (text-only included), one step from the same weights.

What is exact and why: with one chunk (the default on these sizes) the operations are the
unchunked ones, so everything is asserted bit for bit. With several chunks the output head's
weight gradient is a sum over tokens that becomes a sum of per-chunk matmuls (another summation
order), so the loss and gradients are held to the tolerance policy. (Measured, not asserted: on
MKL's AVX-512 sgemm, which computes rows in blocks of 4, 8-token chunks leave the loss, the
evaluation and every gradient but ``lm_head.weight`` bit-equal; 5-token chunks change every
gradient in the last bits. No library promises either.) The right-prediction count is exact.
The peak saved bytes of logits-shaped tensors shrink to about one chunk's."""

from __future__ import annotations

from chunked_cases import chunk_rank, one_step
from tp_cases import Case, family_cls, make_batch

from disagg.testing.dist import run_ranks
from disagg.testing.ranks import dumps, loads
from disagg.testing.tolerance import assert_exact, assert_scalar_close, assert_tensors_close

CHUNK = 8


def _compare(whole: dict, chunked: dict, what: str) -> None:
    assert_scalar_close(chunked["loss"], whole["loss"], f"{what} loss")
    assert_tensors_close(chunked["grads"], whole["grads"], f"{what} gradient of ")
    for i, (g, r) in enumerate(zip(chunked["embed_grads"], whole["embed_grads"], strict=True)):
        assert_tensors_close(g, r, f"{what} sample {i} input-embedding gradient ")
    (loss_c, right_c, n_c), (loss_w, right_w, n_w) = chunked["eval"], whole["eval"]
    assert (right_c, n_c) == (right_w, n_w) and n_w > 0
    assert_scalar_close(loss_c, loss_w, f"{what} eval loss")
    # only one chunk's logits are saved at once: CHUNK of the tokens (the replay's)
    assert chunked["tokens"] > 4 * CHUNK
    assert chunked["logits_bytes"] * chunked["tokens"] <= 1.01 * CHUNK * whole["logits_bytes"], what


def _one_chunk_is_exact(whole: dict, one: dict) -> None:
    assert one["loss"] == whole["loss"] and one["eval"] == whole["eval"]
    assert_exact(one["grads"], whole["grads"], "one chunk: gradient of ")
    for g, r in zip(one["embed_grads"], whole["embed_grads"], strict=True):
        assert_exact(g, r, "one chunk: input-embedding gradient ")


def test_ddp_chunked_equals_whole(tiny_dirs):
    fam = family_cls("qwen2_5_vl")(tiny_dirs["qwen2_5_vl"])
    samples, embeds = make_batch(fam, n_samples=4)
    case = Case("qwen2_5_vl", tiny_dirs["qwen2_5_vl"], 1, 1, 1, samples=samples, embeds=embeds)
    whole, chunked, one = (one_step("ddp", case, 0, c) for c in (None, CHUNK, 10_000))
    _compare(whole, chunked, "ddp")
    _one_chunk_is_exact(whole, one)


def test_megatron_tp_chunked_equals_whole(tiny_dirs):
    """Degree 2 without and with sequence parallelism, in one spawn of two ranks."""
    fam = family_cls("qwen2")(tiny_dirs["qwen2"])  # tied embeddings, vocabulary padded
    samples, embeds = make_batch(fam, n_samples=4)
    cases = [
        Case("qwen2", tiny_dirs["qwen2"], 2, 1, 1, sp, samples=samples, embeds=embeds) for sp in (False, True)
    ]
    payload = dumps(("megatron_tp", cases, (None, CHUNK, 10_000)))
    for r in (loads(b) for b in run_ranks(chunk_rank, 2, payload)):
        for sp, (whole, chunked, one) in zip((False, True), r, strict=True):
            _compare(whole, chunked, f"megatron_tp sp={sp} rank {whole['rank']}")
            _one_chunk_is_exact(whole, one)


def test_chunk_bounds():
    """The last chunk shorter than the others, and a chunk of one token."""
    from disagg.kit.chunked_loss import bounds

    assert bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert bounds(3, 1) == [(0, 1), (1, 2), (2, 3)]
    assert bounds(5, None) == bounds(5, 5) == [(0, 5)]
