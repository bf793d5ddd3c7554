"""Megatron sequence parallelism (``sequence_parallel: true``) against plain
megatron_tp on the same batch: the same loss and gradients (equivalence with
Hugging Face is in test_equivalence.py), less activation memory per rank, and
the collectives Megatron's scheme prescribes."""

from __future__ import annotations

import pytest
from toy_encoder import ToyEncoderFamily
from tp_cases import Case, family_cls, make_batch, run_tp_many

from disagg.testing.tolerance import assert_scalar_close, assert_tensors_close
from disagg_llm_tp.strategy import MegatronTPOptions, MegatronTPStrategy


@pytest.fixture(scope="module")
def runs(tiny_dirs):
    fam = family_cls("qwen2")(tiny_dirs["qwen2"])
    samples, embeds = make_batch(fam, n_samples=4)
    cases = {
        sp: Case("qwen2", tiny_dirs["qwen2"], 2, 1, 1, sp, samples=samples, embeds=embeds)
        for sp in (False, True)
    }
    return run_tp_many(cases)  # one spawn for both


def test_same_loss_and_gradients(runs):
    tp, sp = runs[False][0], runs[True][0]
    assert_scalar_close(sp["loss"], tp["loss"], "loss")
    assert_tensors_close(sp["grads"], tp["grads"], "gradient of ")


def test_less_activation_memory_per_rank(runs):
    for rank in (0, 1):
        tp, sp = runs[False][rank]["activation_bytes"], runs[True][rank]["activation_bytes"]
        # Norm inputs/outputs, residuals and the column linears' saved inputs are
        # kept for half the tokens; attention and MLP interiors are unchanged.
        assert sp < 0.85 * tp, (rank, sp, tp)


def test_collectives_are_gathers_and_reduce_scatters(runs):
    tp, sp = runs[False][0]["collectives"], runs[True][0]["collectives"]
    assert "reduce_scatter" not in tp
    assert sp["reduce_scatter"] > 0 and sp["all_gather"] > 0
    # The per-layer all-reduces are gone: what remains are the embedding's, the
    # vocabulary-parallel cross entropy's and the gradient reductions.
    assert sp.get("all_reduce", 0) < tp["all_reduce"] / 2


def test_check_explains_what_sequence_parallelism_needs(tiny_dirs):
    fam = family_cls("llama")(tiny_dirs["llama"])
    assert MegatronTPStrategy.check(fam, 2, 1, MegatronTPOptions(sequence_parallel=True)) == []
    (problem,) = MegatronTPStrategy.check(fam, 1, 2, MegatronTPOptions(sequence_parallel=True))
    assert "degree >= 2" in problem and "degree is 1" in problem
    (problem,) = MegatronTPStrategy.check(
        ToyEncoderFamily("."), 2, 1, MegatronTPOptions(sequence_parallel=True)
    )
    assert "'toy_tp_encoder' declares no sequence-parallel regions" in problem and "allowed: false" in problem
