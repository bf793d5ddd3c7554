"""Video files -> the frames an encoder family reads, sampled as Qwen's processing samples them.

Decoding is PyAV's (``pip install 'disagg-core[video]'``). Sampling follows
transformers' ``Qwen2VLVideoProcessor.sample_frames`` with ``fps`` (the count is
qwen-vl-utils' ``smart_nframes``): ``duration * data.video_fps`` frames, at least
``MIN_FRAMES``, at most ``data.video_max_frames`` and the video's own frame count
(both rounded down to the frame factor, the tower's temporal patch), rounded down
to the frame factor; frame ``k`` of ``n`` is source frame ``int(k * total / n)``.
The sampled rate (``n / total * source fps``) is what sets MRoPE's time axis
(``second_per_grid_ts = frame_factor / sampled_fps``).
A video shorter than one temporal patch keeps all its frames (the family repeats
the last one, as the processor's patchify does); transformers refuses it.

``sampling="qwen3_vl"`` follows ``Qwen3VLVideoProcessor.sample_frames`` instead
(:func:`sample_indices_qwen3`): ``int(duration * data.video_fps)`` frames, at least
``MIN_FRAMES``, at most ``data.video_max_frames`` and the frame count, no rounding to
the temporal patch (its patchify repeats the last frame), taken at
``round(linspace(0, total - 1, n))``.

``sampling="internvl"`` follows ``InternVLVideoProcessor.sample_frames``
(:func:`sample_indices_internvl`): ``int(duration * data.video_fps)`` frames, at most
``data.video_max_frames``, each from the middle of its span.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

#: transformers' Qwen2VLVideoProcessor.min_frames and qwen-vl-utils' FPS_MIN_FRAMES
MIN_FRAMES = 4
INSTALL_HINT = "video rows need PyAV: pip install 'disagg-core[video]' (or pip install av)"


@dataclass
class Video:
    """One decoded video: only its sampled frames are kept."""

    #: ``[n, H, W, 3]`` uint8 RGB, the sampled frames in order
    frames: np.ndarray
    #: source frame index of each sampled frame
    indices: list[int]
    total_frames: int
    #: the stream's average frame rate
    fps: float
    #: file name, for errors
    path: str
    #: the rate asked for (``data.video_fps``): Qwen2.5-Omni's processor sets MRoPE's time axis
    #: from it (``video_second_per_grid = temporal_patch_size / fps``), not from the sampled rate
    requested_fps: float = 2.0

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the sampled frames (transformers' ``VideoMetadata.sampled_fps``)."""
        return len(self.indices) / self.total_frames * self.fps


def require_av() -> None:
    """Raise ImportError with the install line when PyAV is missing."""
    try:
        import av  # noqa: F401
    except ImportError:
        raise ImportError(INSTALL_HINT) from None


def sample_indices(total: int, video_fps: float, *, fps: float, max_frames: int, factor: int) -> list[int]:
    """Source frame indices to keep of a ``total``-frame video recorded at ``video_fps``."""
    if total < factor:
        return list(range(total))
    cap = math.floor(min(max_frames, total) / factor) * factor
    n = total / video_fps * fps
    n = min(max(n, MIN_FRAMES), cap, total)
    n = math.floor(n / factor) * factor
    if n < factor:  # max_frames below one temporal patch: one patch's worth
        n = factor
    import torch

    # the processor's own expression (a float step), so rounding picks the same frames
    return [int(i) for i in torch.arange(0, total, total / n).int().tolist()]


def sample_indices_qwen3(total: int, video_fps: float, *, fps: float, max_frames: int) -> list[int]:
    """Source frame indices as transformers' ``Qwen3VLVideoProcessor.sample_frames`` picks them
    (``fps`` given, ``min_frames`` = ``MIN_FRAMES``)."""
    n = int(total / video_fps * fps)
    n = min(max(n, MIN_FRAMES), max_frames, total)
    return [int(i) for i in np.linspace(0, total - 1, n).round().astype(int)]


def sample_indices_internvl(total: int, video_fps: float, *, fps: float, max_frames: int) -> list[int]:
    """Source frame indices as transformers' ``InternVLVideoProcessor.sample_frames`` picks them
    with ``num_frames = min(int(duration * fps), max_frames)`` (``initial_shift`` on: frames from
    the middle of equal spans). At least one frame and at most the video's own (transformers
    refuses both cases)."""
    import torch

    n = max(1, min(int(total / video_fps * fps), max_frames, total))
    shift = total / n / 2
    return [int(i) for i in torch.arange(shift, total, total / n).int().tolist()]


#: ``sampling`` -> indices(total, video_fps, fps=, max_frames=, factor=)
SAMPLERS = {
    "qwen2_vl": sample_indices,
    "qwen3_vl": lambda total, video_fps, *, fps, max_frames, factor: sample_indices_qwen3(
        total, video_fps, fps=fps, max_frames=max_frames
    ),
    "internvl": lambda total, video_fps, *, fps, max_frames, factor: sample_indices_internvl(
        total, video_fps, fps=fps, max_frames=max_frames
    ),
}


def load_video(
    path: str | bytes, *, fps: float, max_frames: int, factor: int, sampling: str = "qwen2_vl"
) -> Video:
    """Decode ``path`` (a file or its bytes) and keep the sampled frames; raises PyAV's own error
    on a file it cannot decode, ValueError on a file without a video stream or frames."""
    require_av()
    import av

    name = "<bytes>" if isinstance(path, bytes) else path

    def source():  # noqa: ANN202 - a file name or a fresh buffer for each pass
        return io.BytesIO(path) if isinstance(path, bytes) else path

    with av.open(source()) as container:
        if not container.streams.video:
            raise ValueError("no video stream in the file")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        total = int(stream.frames or 0)
        if not total:  # containers without a frame count in their header: count the packets
            total = sum(1 for p in container.demux(stream) if p.size)
    if not rate:
        raise ValueError("the video stream states no frame rate")
    video_fps = float(rate)
    if total == 0:
        raise ValueError("the video has no frames")
    sampler = SAMPLERS[sampling]
    wanted = sampler(total, video_fps, fps=fps, max_frames=max_frames, factor=factor)
    keep = set(wanted)
    frames: dict[int, np.ndarray] = {}
    decoded = 0
    with av.open(source()) as container:
        for k, frame in enumerate(container.decode(video=0)):
            decoded = k + 1
            if k in keep:
                frames[k] = frame.to_ndarray(format="rgb24")
    if decoded != total:  # the header's count was wrong: sample again over what decodes
        if decoded == 0:
            raise ValueError("no frame could be decoded")
        return _resample(
            path, decoded, video_fps, sampler, fps=fps, max_frames=max_frames, factor=factor, name=name
        )
    return Video(np.stack([frames[i] for i in wanted]), wanted, total, video_fps, name, fps)


def _resample(
    path: str | bytes,
    total: int,
    video_fps: float,
    sampler: Any,
    *,
    fps: float,
    max_frames: int,
    factor: int,
    name: str,
) -> Video:
    import av

    wanted = sampler(total, video_fps, fps=fps, max_frames=max_frames, factor=factor)
    keep = set(wanted)
    frames: dict[int, np.ndarray] = {}
    with av.open(io.BytesIO(path) if isinstance(path, bytes) else path) as container:
        for k, frame in enumerate(container.decode(video=0)):
            if k in keep:
                frames[k] = frame.to_ndarray(format="rgb24")
    return Video(np.stack([frames[i] for i in wanted]), wanted, total, video_fps, name, fps)
