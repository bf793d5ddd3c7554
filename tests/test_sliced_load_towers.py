"""Sharded build and load of the encoder towers under ``megatron_tp`` (issue 26 item 1):
each rank builds its tower on the meta device (the family's ``build_empty``), parallelizes
it and reads only its own slices of the dir's safetensors, as the LLM families do
(``packages/llm-tp/tests/test_sliced_load.py``); the result equals the whole tower loaded
and cut by the strategy, bit for bit, and no rank reads more than its share.

Towers, degree 2, one spawn: Qwen2.5-VL (window attention, fused qkv, the merger's MLP;
Qwen2-VL's family is it with other linear names), Qwen3-VL (learned position embedding,
DeepStack mergers), LLaVA with a CLIP tower (class embedding, pre-norm; SigLIP's goes through
the same family code), Qwen2-Audio (tower and projector), each from its whole-model dir,
whose other tensors stay unread; and Whisper from a plain dir (only the Whisper model: the
projector is drawn from ``projector_seed``, each rank just its rows or columns, the family's
``stored_tensors``) and from an exported one (the encoder with its trained projector).
Host memory on a larger tower: examples/bench/setup_memory.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from disagg.interfaces.stored import StoredTensors
from disagg_audio.families.qwen2_audio import Qwen2AudioFamily
from disagg_audio.families.whisper import WhisperAudioFamily
from disagg_llm_tp.families.base import write_hf_dir
from disagg_llm_tp.testing import check_sliced_load
from disagg_vision_sp.families.llava import LlavaVision
from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision
from disagg_vision_sp.families.qwen3_vl import Qwen3VLVision


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    root = tmp_path_factory.mktemp("towers")
    llava_clip = LlavaVision.tiny_variants()["llava_clip"]
    return [
        ("vision", Qwen2_5_VLVision(Qwen2_5_VLVision.make_tiny(root / "qwen2_5_vl"))),
        ("vision", Qwen3VLVision(Qwen3VLVision.make_tiny(root / "qwen3_vl"))),
        ("vision", LlavaVision(llava_clip(root / "llava_clip"))),
        ("audio", Qwen2AudioFamily(Qwen2AudioFamily.make_tiny(root / "qwen2_audio"))),
        ("audio", _plain_whisper(root)),
        ("audio", _exported_whisper(root)),
    ]


#: stack pooling: the projector's input is stride x d_model wide (64), its output 48
PLAIN_WHISPER = {"hidden_size": 48, "pooling": "stack", "stride": 2, "projector_seed": 3}


def _plain_whisper(root: Path) -> WhisperAudioFamily:
    plain = WhisperAudioFamily(WhisperAudioFamily.make_tiny(root / "whisper"), PLAIN_WHISPER)
    assert not any(k.startswith("projector.") for k in StoredTensors(plain.path).files)
    return plain


def _exported_whisper(root: Path) -> WhisperAudioFamily:
    options = {"hidden_size": 48}
    plain = WhisperAudioFamily(root / "whisper", options)
    tensors = plain.export_state(plain.build().state_dict())
    return WhisperAudioFamily(write_hf_dir(plain.path, root / "whisper_exported", tensors), options)


def test_plain_whisper_draws_its_projector_from_its_seed(towers):
    """What the sliced load of the plain dir must reproduce: nn.Linear's default scale, zero
    biases, rows that differ, another seed another projector, the same seed the same one."""
    family = towers[4][1]
    proj = family.build().projector
    for lin, fan_in in ((proj.linear_1, 64), (proj.linear_2, 48)):
        w = lin.weight.detach()
        assert w.shape[1] == fan_in and float(w.abs().max()) <= fan_in**-0.5
        assert abs(float(w.std()) - fan_in**-0.5 / 3**0.5) < 0.1 * fan_in**-0.5  # U(-b, b): std b / sqrt 3
        assert not torch.equal(w[0], w[1]) and not bool(lin.bias.any())
    again = WhisperAudioFamily(family.path, dict(PLAIN_WHISPER)).build().projector
    other = WhisperAudioFamily(family.path, {**PLAIN_WHISPER, "projector_seed": 4}).build().projector
    assert torch.equal(again.linear_2.weight, proj.linear_2.weight)
    assert not torch.equal(other.linear_2.weight, proj.linear_2.weight)


def test_towers_sliced_load_equals_whole_and_reads_only_own_slices(towers):
    # the attention's q/k/v (or fused qkv) and output, the MLP's column and row linears
    check_sliced_load(towers, degree=2, min_split=4)
