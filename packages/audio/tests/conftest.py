"""Tiny model dirs (random weights, offline) and the speech clips of ``data/``.

The clips were synthesised with espeak-ng 1.51 ("hello world", "the quick
brown fox jumps over the lazy dog" at -s 190, "one two three"; 22.05 kHz) and
written with soundfile: a 44.1 kHz FLAC, a 16 kHz WAV, a 22.05 kHz OGG/Vorbis
and MP3 of the same words.
"""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def clips() -> dict[str, Path]:
    return {p.name: p for p in sorted(DATA.iterdir())}


@pytest.fixture(scope="session")
def tiny_whisper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from disagg_audio.families.whisper import WhisperAudioFamily

    return WhisperAudioFamily.make_tiny(tmp_path_factory.mktemp("tiny") / "whisper")


@pytest.fixture(scope="session")
def tiny_qwen2_audio(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from disagg_audio.families.qwen2_audio import Qwen2AudioFamily

    return Qwen2AudioFamily.make_tiny(tmp_path_factory.mktemp("tiny") / "qwen2_audio")
