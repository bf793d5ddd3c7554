"""Decoding media files into what encoder families' ``preprocess`` receives.

Images become RGB ``PIL.Image.Image``; audio becomes ``{"array": float32 mono
numpy array in [-1, 1], "sampling_rate": int}`` (the convention of Hugging
Face ``datasets``' Audio feature, which HF feature extractors accept).
Resampling is the family's business: it knows the rate its model expects.
"""

from __future__ import annotations

import io
import wave
from typing import Any

import numpy as np


def load_media(kind: str, path: str | bytes) -> Any:
    """One decoded media item from a file path or the file's bytes (what a Hugging Face
    dataset stores); raises the decoder's own error on bad files."""
    if kind == "image":
        return load_image(path)
    if kind == "audio":
        return load_audio(path)
    raise ValueError(f"unknown media kind {kind!r}; allowed: image, audio")


def load_image(path: str | bytes):
    from PIL import Image

    with Image.open(io.BytesIO(path) if isinstance(path, bytes) else path) as im:
        # load() forces a full decode so truncated files fail here, not in the encoder
        im.load()
        return im.convert("RGB")


def load_audio(path: str | bytes) -> dict[str, Any]:
    """``{"array", "sampling_rate", "path"}``; the path lets a family's errors name the file.

    With ``soundfile`` installed (disagg-audio brings it) every format
    libsndfile reads is decoded by it, WAV included (24-bit and float WAVs too);
    without it, 8/16/32-bit PCM WAV through the standard library."""
    try:
        import soundfile
    except ImportError:
        soundfile = None
    name = "<bytes>" if isinstance(path, bytes) else path
    source = io.BytesIO(path) if isinstance(path, bytes) else path
    if soundfile is not None:
        data, rate = soundfile.read(source, dtype="float32", always_2d=True)
        return {"array": data.mean(axis=1).astype(np.float32), "sampling_rate": int(rate), "path": name}
    if isinstance(path, str) and not path.lower().endswith(".wav"):
        raise ValueError(f"cannot read {path!r}: only .wav is supported without the 'soundfile' package")
    with wave.open(source, "rb") as w:
        width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
        frames = w.readframes(w.getnframes())
    dtype = {1: np.uint8, 2: np.int16, 4: np.int32}.get(width)
    if dtype is None:
        raise ValueError(f"unsupported WAV sample width {width} bytes; allowed: 1, 2, 4")
    data = np.frombuffer(frames, dtype=dtype).astype(np.float32)
    if width == 1:
        data = (data - 128.0) / 128.0
    else:
        data /= float(np.iinfo(dtype).max)
    data = data.reshape(-1, channels).mean(axis=1)
    return {"array": data.astype(np.float32), "sampling_rate": rate, "path": name}
