"""Forward-only evaluation under megatron_tp: the loss and the argmax accuracy
are those of the single-process model, although each rank holds only a slice
of the vocabulary (and the last slice ends in padding columns)."""

from __future__ import annotations

import pytest
from tp_cases import Case, family_cls, make_batch, reference, run_tp

from disagg.testing.tolerance import assert_scalar_close


@pytest.mark.parametrize("degree,sp", [(2, False), (4, True)])
def test_evaluate_matches_single_process(tiny_dirs, degree, sp):
    fam = family_cls("qwen2")(tiny_dirs["qwen2"])  # vocabulary 498: 2 padding columns at degree 4
    samples, embeds = make_batch(fam, n_samples=4)
    ref = reference(Case("qwen2", tiny_dirs["qwen2"], degree, steps=1, samples=samples, embeds=embeds))
    # Relabel every label token with the reference model's own prediction, so a right
    # answer is "all correct" (a random tiny model would otherwise be right ~never).
    preds, offset = ref["logits"].argmax(-1), 0
    for s in samples:
        n = len(s["input_ids"]) - 1
        keep = s["labels"][1:] != -100
        s["labels"][1:][keep] = preds[offset : offset + n][keep]
        offset += n
    assert int(preds.max()) >= 498 // 2, "some predictions must come from the upper vocabulary slices"

    case = Case("qwen2", tiny_dirs["qwen2"], degree, 1, 1, sp, samples=samples, embeds=embeds)
    ref_eval = reference(case)
    loss, correct, count = runs_eval(case)
    assert count == sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    assert correct == count
    assert_scalar_close(loss, ref_eval["loss"], "evaluate loss sum")


def runs_eval(case: Case) -> tuple[float, int, int]:
    outs = run_tp(case)
    assert all(o["eval"] == outs[0]["eval"] for o in outs), "TP ranks of a replica must agree"
    return outs[0]["eval"]
