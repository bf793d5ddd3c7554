"""The ``audio`` entry point of group ``disagg``: registers the audio encoder families
``whisper`` and ``qwen2_audio`` (each runs under ``ddp``, ``zero``, ``ulysses`` or
``megatron_tp``, when the plugin of that strategy is installed)."""

from __future__ import annotations

from typing import Callable

from disagg import hookimpl


@hookimpl
def disagg_register_families(register: Callable[[type], None]) -> None:
    from disagg_audio.families.qwen2_5_omni import Qwen2_5OmniAudioFamily
    from disagg_audio.families.qwen2_audio import Qwen2AudioFamily
    from disagg_audio.families.whisper import WhisperAudioFamily

    register(WhisperAudioFamily)
    register(Qwen2AudioFamily)
    register(Qwen2_5OmniAudioFamily)
