"""Waveforms -> windows of log-mel features, the input of Whisper-style encoders.

A Whisper-style encoder reads one window of ``chunk_length`` seconds
(``n_samples`` at ``sampling_rate``); longer clips are cut into consecutive
windows, each encoded on its own. A window is trimmed to the encoder
positions its audio covers, rounded up to a whole number of output rows (the
rounding adds at most ``multiple - 1`` positions of the silence the feature
extractor pads with), so the placeholder count grows with the length of the
clip instead of always being a full window.

Per sample, ``preprocess`` returns:

- ``input_features`` ``[W, n_mels, F]`` float32: log-mel frames of the W windows
  of all items, each holding the ``2 * positions + 1`` frames its encoder
  positions read (the first convolution looks one frame ahead), zero beyond;
- ``positions`` ``[W]`` int64: encoder positions kept per window (after the
  stride-2 convolution), a multiple of the family's rows-per-window unit;
- ``windows`` ``[n_items]`` int64: how many windows each item was cut into.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from disagg_audio.decode import load_waveform


@functools.lru_cache(maxsize=8)
def feature_extractor(path: str) -> Any:
    """The dir's ``WhisperFeatureExtractor`` (from ``preprocessor_config.json``; cached per
    dir since data workers call ``preprocess`` per sample)."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor.from_pretrained(path)


def conv_positions(mel_frames: int) -> int:
    """Encoder positions after Whisper's stride-2 convolution (kernel 3, padding 1)."""
    return (mel_frames - 1) // 2 + 1


def window_inputs(
    items: list[Any], fe: Any, multiple: int, max_seconds: float | None
) -> dict[str, torch.Tensor]:
    """All items of one sample -> ``input_features``/``positions``/``windows`` (see module doc)."""
    rate, size = int(fe.sampling_rate), int(fe.n_samples)
    full_frames = int(fe.nb_max_frames)
    chunks: list[np.ndarray] = []
    windows: list[int] = []
    for item in items:
        samples, _ = load_waveform(item, rate, max_seconds)
        parts = [samples[i : i + size] for i in range(0, samples.size, size)]
        chunks += parts
        windows.append(len(parts))
    out = fe(
        chunks,
        sampling_rate=rate,
        padding="max_length",
        return_attention_mask=True,
        return_tensors="np",
    )
    mel, valid = out["input_features"], out["attention_mask"].sum(axis=1)
    positions = []
    for n_frames in valid.tolist():
        # Round up to whole output rows; never past the window (its positions are a multiple too).
        kept = min(math.ceil(conv_positions(int(n_frames)) / multiple) * multiple, full_frames // 2)
        positions.append(kept)
    frames = min(2 * max(positions) + 1, full_frames)
    feats = torch.zeros(len(chunks), mel.shape[1], frames, dtype=torch.float32)
    for w, kept in enumerate(positions):
        f = min(2 * kept + 1, full_frames)
        feats[w, :, :f] = torch.from_numpy(np.ascontiguousarray(mel[w, :, :f]))
    return {
        "input_features": feats,
        "positions": torch.tensor(positions, dtype=torch.int64),
        "windows": torch.tensor(windows, dtype=torch.int64),
    }
