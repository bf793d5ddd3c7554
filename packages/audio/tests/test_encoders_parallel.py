"""``whisper`` (Ultravox-style stacking of 5 positions per row) and
``qwen2_audio`` under ``ulysses`` 2 and ``megatron_tp`` 2 equal Hugging Face's
own encoder forward in one process (``disagg_audio.testing``: Qwen2-Audio's
masked tower and projector; Whisper's encoder masked as Qwen2-Audio masks it,
Voxtral's stacking, LLaVA's projector) on a ragged batch: clips of different
lengths, one spanning three windows, a sample with two clips, a clip shorter
than one row group; outputs and gradients within 1e-5 relative."""

from __future__ import annotations

import pytest
from harness import assert_matches, ragged_clips, run_strategy, upstream_grads

from disagg_audio.families.qwen2_audio import Qwen2AudioFamily
from disagg_audio.families.whisper import WhisperAudioFamily
from disagg_audio.testing import hf_reference

# seconds per clip, per sample (1 s windows in the tiny models): 3 windows; 2 clips; a sliver; 1 window
SECONDS = [[2.3], [0.7, 0.45], [0.03], [1.0]]


def _case(family):
    clips = ragged_clips(SECONDS)
    inputs = [family.preprocess(items) for items in clips]
    grads = upstream_grads(family, inputs)
    outs, pgrads = hf_reference(family, clips, grads)
    return family, inputs, grads, outs, pgrads


@pytest.fixture(scope="module")
def whisper_case(tiny_whisper):
    return _case(WhisperAudioFamily(tiny_whisper, {"hidden_size": 24, "pooling": "stack", "stride": 5}))


@pytest.fixture(scope="module")
def qwen2_audio_case(tiny_qwen2_audio):
    return _case(Qwen2AudioFamily(tiny_qwen2_audio))


def test_ragged_rows(whisper_case, qwen2_audio_case):
    # one count per clip; 50 positions per full window: whisper stride 5 -> 10 rows, qwen2_audio 25
    fam, inputs, *_ = whisper_case
    assert [fam.num_tokens(x) for x in inputs] == [[23], [7, 5], [1], [10]]
    fam, inputs, *_ = qwen2_audio_case
    assert [fam.num_tokens(x) for x in inputs] == [[58], [18, 12], [1], [25]]


def _check(strategy, cases):
    results = run_strategy(strategy, 2, 1, [(fam, inputs, grads) for fam, inputs, grads, _, _ in cases])
    for (family, _, _, ref_outs, ref_grads), res in zip(cases, results):
        assert_matches(res, ref_outs, ref_grads, family.hidden_size())
    return results


def test_ulysses_matches_single_process(whisper_case, qwen2_audio_case):
    """Degree 2, both families in one spawn of the ranks (start-up dominates the cost)."""
    pytest.importorskip("disagg_vision_sp")
    results = _check("ulysses", [whisper_case, qwen2_audio_case])
    # the frames really were split: attention crossed ranks
    assert all(r["all_to_all_bytes"] > 0 for res in results for r in res)


def test_megatron_tp_matches_single_process(whisper_case, qwen2_audio_case):
    pytest.importorskip("disagg_llm_tp")
    _check("megatron_tp", [whisper_case, qwen2_audio_case])
