"""FSDP + CP for the LLM: ``ddp`` with ``shard: parameters`` and ``gradients`` (FSDP2 over all
4 ranks) at CP 2 x 2 replicas on text-only Qwen2, one step against the single-process Hugging
Face model (loss, every weight gradient, the squared norm) and a forward-only evaluation, with
replica 1 holding no sample: its two CP ranks forward the family's placeholder sample
(:mod:`disagg.kit.lockstep`) so that every rank makes FSDP2's gathers and reduce-scatters.
A rank that skipped it would leave the others in a gather: the spawn's timeout fails the test.
One spawn of 4 gloo ranks."""

from __future__ import annotations

import pytest
from cp_cases import fsdp_rank, text_batch
from tp_cases import family_cls

from disagg.testing.dist import run_ranks
from disagg.testing.ranks import dumps, loads
from disagg.testing.tolerance import assert_scalar_close, assert_tensors_close

MODES = ("parameters", "gradients")


@pytest.fixture(scope="module")
def results(tiny_dirs):
    path = tiny_dirs["qwen2"]
    samples = text_batch(family_cls("qwen2")(path).text_config.vocab_size, (13, 3, 22))
    out = [loads(b) for b in run_ranks(fsdp_rank, 4, dumps((path, samples, MODES)), timeout=240)]
    return out, out[0][-1], sum(int((s["labels"][1:] != -100).sum()) for s in samples)


@pytest.mark.parametrize("mode", range(len(MODES)), ids=MODES)
def test_fsdp_context_parallel_with_an_empty_replica_equals_hf(results, mode):
    per_rank, ref, labels = results
    rows = [r[mode] for r in per_rank]
    name = f"ddp shard: {MODES[mode]} cp2 x2"
    by_replica = {r["replica"]: r["loss"] for r in rows}
    assert by_replica[1] == 0.0
    assert_scalar_close(by_replica[0], ref["loss"], f"{name} loss")
    want_norm = float(sum((g.double() ** 2).sum() for g in ref["grads"].values()))
    for i, r in enumerate(rows):
        assert set(r["grads"]) == set(ref["grads"]), name
        assert_tensors_close(r["grads"], ref["grads"], f"{name} rank {i} gradient of ")
        assert_scalar_close(r["norm_sq"], want_norm, f"{name} rank {i} grad norm^2")
        # evaluation: replica 0's loss is the step's (same weights), the placeholder counts nothing
        loss, _, labelled = r["eval"]
        if r["replica"] == 0:
            assert_scalar_close(loss, ref["loss"], f"{name} rank {i} eval loss")
            assert labelled == labels, (name, labelled, labels)
        else:
            assert r["eval"] == (0.0, 0, 0)
