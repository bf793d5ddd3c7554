"""Audio files -> mono float32 waveforms at the rate a family's model expects.

Decoding is libsndfile's (``soundfile``): WAV, FLAC, OGG/Vorbis/Opus and MP3
(libsndfile >= 1.1, bundled in soundfile's wheels) through one well-kept C
library with no ffmpeg/torchcodec system dependency. Resampling is soxr's
(the SoX resampler, high quality by default), deterministic and fast on CPU.

Every failure names the file: a corrupt, empty or unreadable clip raises
:class:`AudioError` and is never replaced by silence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

#: extensions the decoder is exercised on (libsndfile reads more; these are what we promise)
FORMATS = (".wav", ".flac", ".ogg", ".mp3")


class AudioError(ValueError):
    """A clip that cannot be used; the message starts with the file."""


def decode_file(path: str | Path) -> tuple[np.ndarray, int]:
    """``(mono float32 samples in [-1, 1], sampling rate)`` of an audio file."""
    import soundfile

    p = Path(path)
    if not p.is_file():
        raise AudioError(f"{p}: audio file not found")
    if p.stat().st_size == 0:
        raise AudioError(f"{p}: empty audio file (0 bytes)")
    try:
        data, rate = soundfile.read(str(p), dtype="float32", always_2d=True)
    except Exception as exc:  # libsndfile reports corrupt and unknown formats as LibsndfileError/RuntimeError
        raise AudioError(
            f"{p}: cannot decode audio ({type(exc).__name__}: {exc}); readable formats: {', '.join(FORMATS)}"
        ) from exc
    return data.mean(axis=1, dtype=np.float32), int(rate)


def as_waveform(item: Any) -> tuple[np.ndarray, int, str]:
    """``(samples, rate, name)`` of one media item: a path, or a decoded
    ``{"array", "sampling_rate"[, "path"]}`` dict (core's ``load_media`` and HF
    ``datasets``' Audio feature), or an ``(array, rate)`` pair."""
    if isinstance(item, (str, Path)):
        samples, rate = decode_file(item)
        return samples, rate, str(item)
    if isinstance(item, dict) and "array" in item and "sampling_rate" in item:
        name = str(item.get("path") or "<audio array>")
        samples, rate = np.asarray(item["array"]), item["sampling_rate"]
    elif isinstance(item, tuple) and len(item) == 2:
        (samples, rate), name = item, "<audio array>"
        samples = np.asarray(samples)
    else:
        raise AudioError(
            f"unsupported audio item {type(item).__name__}; allowed: a file path, "
            "{'array': ..., 'sampling_rate': ...}, or (array, sampling_rate)"
        )
    if samples.ndim == 2:  # (frames, channels), soundfile's layout
        samples = samples.mean(axis=1)
    if samples.ndim != 1:
        raise AudioError(f"{name}: audio array must be 1-D (mono) or 2-D (frames, channels)")
    return samples.astype(np.float32, copy=False), int(rate), name


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """``samples`` at ``rate`` Hz -> ``target`` Hz (unchanged when equal)."""
    if rate == target:
        return samples
    import soxr

    return soxr.resample(samples, rate, target).astype(np.float32, copy=False)


def load_waveform(item: Any, target_rate: int, max_seconds: float | None = None) -> tuple[np.ndarray, str]:
    """Decode, check and resample one item; ``(samples at target_rate, name)``."""
    samples, rate, name = as_waveform(item)
    if rate <= 0:
        raise AudioError(f"{name}: invalid sampling rate {rate}")
    if samples.size == 0:
        raise AudioError(f"{name}: the clip holds no samples (0.0 s of audio)")
    if not np.isfinite(samples).all():
        raise AudioError(f"{name}: the clip holds NaN or infinite samples")
    seconds = samples.size / rate
    if max_seconds is not None and seconds > max_seconds:
        raise AudioError(
            f"{name}: {seconds:.1f} s of audio exceeds model.audio.options.max_seconds={max_seconds}; "
            "raise it or trim the clip"
        )
    return resample(samples, rate, target_rate), name
