"""The audio towers under the ``train.precision`` recipes: ``whisper`` and ``qwen2_audio`` under
``ulysses`` 2 and ``megatron_tp`` 2 each equal the same strategy at degree 1 (one process) under
the same recipe (``bf16``; Whisper also ``bf16-pure``) over 5 steps (``disagg.testing.recipes``:
the loss 0.5 ||output - target||^2 to fixed random targets at the output's scale, positive at
every step, within 5 bf16 epsilons; first-step gradients per element within the recipe's bound;
parameters in learning-rate units, a skipped or doubled update fails); weights, masters,
gradients and AdamW state are held in the recipe's dtypes and the rows go to the LLM in the
compute dtype. One spawn of the ranks for every case (measured largest margin 0.77: a
LayerNorm bias gradient under ulysses, summed from the ranks' partials)."""

from __future__ import annotations

import pytest
from audio_recipe_cases import OPTIM, RECIPES, STRATEGIES, audio_recipe_rank
from harness import ragged_clips

from disagg.interfaces import RECIPES as TABLE
from disagg.testing.dist import run_ranks
from disagg.testing.ranks import loads
from disagg.testing.recipes import assert_same_recipe, encoder_targets, gather_single_rank, held_dtypes
from disagg_audio.families.qwen2_audio import Qwen2AudioFamily
from disagg_audio.families.whisper import WhisperAudioFamily

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

# seconds per clip, per sample (1 s windows in the tiny models): a full window and a trimmed one;
# a sample of two short clips (bf16 matmuls are slow on CPUs without bf16 units: few positions).
# Ulysses 2 splits every window's positions over its ranks.
SECONDS = [[1.2], [0.3, 0.2]]
FAMILIES = {
    "whisper": (WhisperAudioFamily, {"hidden_size": 24, "pooling": "stack", "stride": 5}),
    "qwen2_audio": (Qwen2AudioFamily, {}),
}
#: Whisper under both recipes; Qwen2-Audio's tower (the same layers, HF's masked copy of Whisper's
#: encoder, average pooling and its own projector) under ``bf16`` alone: bf16 matmuls are slow
#: on CPUs without bf16 units, and ``bf16-pure`` differs from ``bf16`` in what is stored, not in
#: the tower's arithmetic
CASES = [("whisper", s, p) for s in STRATEGIES for p in RECIPES] + [
    ("qwen2_audio", s, "bf16") for s in STRATEGIES
]


@pytest.fixture(scope="module")
def recipe_case(tiny_whisper, tiny_qwen2_audio):
    paths = {"whisper": tiny_whisper, "qwen2_audio": tiny_qwen2_audio}
    clips = ragged_clips(SECONDS)
    cases = {}
    for name, (cls, options) in FAMILIES.items():
        family = cls(paths[name], options)
        inputs = [family.preprocess(items) for items in clips]
        cases[name] = (cls, str(paths[name]), options, inputs, encoder_targets(family, inputs))
    return gather_single_rank(
        [loads(b) for b in run_ranks(audio_recipe_rank, 2, cases, CASES)], lambda k: k[2] == 1
    )


def _compare(got: dict, want: dict, precision: str, what: str) -> None:
    assert_same_recipe(got, want, precision, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, what=what)


@pytest.mark.parametrize("family,strategy,precision", CASES)
def test_degree_2_equals_degree_1_under_the_recipe(recipe_case, family, strategy, precision):
    got, want = (
        recipe_case[0][(family, strategy, 2, precision)],
        recipe_case[0][(family, strategy, 1, precision)],
    )
    for res in (got, want, recipe_case[1][(family, strategy, 2, precision)]):
        assert res["out_dtypes"] <= {TABLE[precision].weights}  # rows go to the LLM in the compute dtype
        held = tuple(res[k] for k in ("weight_dtypes", "param_dtypes", "grad_dtypes", "state_dtypes"))
        assert held == held_dtypes(precision), held
    _compare(got, want, precision, f"{family} {strategy} x2 ")


@pytest.mark.parametrize("wrong", ["skipped", "applied twice"])
def test_a_wrong_update_fails_the_comparison(recipe_case, wrong):
    got, want = (
        recipe_case[0][("whisper", "megatron_tp", 2, "bf16")],
        recipe_case[0][("whisper", "megatron_tp", 1, "bf16")],
    )
    p0, factor = got["initial"], (0.0 if wrong == "skipped" else 2.0)
    bad = {
        n: (p0[n].double() + factor * (p.double() - p0[n].double())).to(p.dtype)
        for n, p in got["params"].items()
    }
    with pytest.raises(AssertionError, match="lr-units"):
        _compare({**got, "params": bad}, want, "bf16", "whisper megatron_tp x2 ")
