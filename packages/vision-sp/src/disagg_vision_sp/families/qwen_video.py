"""Qwen2-VL style video inputs: sampled frames -> ``pixel_values_videos``, ``video_grid_thw``,
``second_per_grid_ts``, as transformers' ``Qwen2VLVideoProcessor`` and ``Qwen2_5_VLProcessor``
compute them (that processor needs torchvision; this reads the same facts from the family's own
``preprocessor_config.json`` and resizes frames with PIL, the image processor's resampler;
transformers' PIL-backend module gives ``smart_resize`` without torchvision).

- each frame is resized to ``smart_resize(h, w, factor=patch*merge, min_pixels, max_pixels)``
  (transformers' function; defaults 128*28*28 / 768*28*28 as both transformers' video processor
  and qwen-vl-utils), then rescaled and normalized with the image processor's mean/std;
- frames are padded to a multiple of ``temporal_patch_size`` by repeating the last one;
- patches are laid out ``(t, h/merge, w/merge, merge, merge)`` with each patch's vector
  ``(channel, temporal, patch, patch)``, so a merge unit's 4 patches are adjacent;
- ``second_per_grid_ts = temporal_patch_size / sampled_fps`` per video.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

#: transformers' Qwen2VLVideoProcessor.size and qwen-vl-utils' VIDEO_MIN/MAX_PIXELS
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28


def video_inputs(
    videos: list[Any],
    processor: Any,
    *,
    patch: int,
    merge: int,
    temporal: int,
    min_pixels: int = VIDEO_MIN_PIXELS,
    max_pixels: int = VIDEO_MAX_PIXELS,
) -> dict[str, torch.Tensor]:
    """``videos``: :class:`disagg.data.video.Video` (``frames`` ``[n, H, W, 3]`` uint8,
    ``sampled_fps``); ``processor``: the family's image processor (rescale, mean, std, resample)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    rows, grids, seconds = [], [], []
    for v in videos:
        n, h, w, _ = v.frames.shape
        rh, rw = smart_resize(h, w, factor=patch * merge, min_pixels=min_pixels, max_pixels=max_pixels)
        x, grid = _patches(v.frames, rh, rw, processor, patch=patch, merge=merge, temporal=temporal)
        rows.append(x)
        grids.append(grid)
        seconds.append(temporal / v.sampled_fps)
    return {
        "pixel_values_videos": torch.cat(rows),
        "video_grid_thw": torch.tensor(grids, dtype=torch.long),
        "second_per_grid_ts": torch.tensor(seconds, dtype=torch.float32),
    }


def _patches(
    frames: np.ndarray, rh: int, rw: int, processor: Any, *, patch: int, merge: int, temporal: int
) -> tuple[torch.Tensor, list[int]]:
    """Frames resized to ``rh x rw``, rescaled, normalized, padded to the temporal patch and
    laid out ``(t, h/merge, w/merge, merge, merge)`` x ``(channel, temporal, patch, patch)``."""
    n = frames.shape[0]
    x = torch.from_numpy(np.stack([_resize(f, rw, rh, processor) for f in frames]))  # [n, H, W, 3]
    x = x.permute(0, 3, 1, 2).to(torch.float32) * float(processor.rescale_factor)
    mean = torch.tensor(processor.image_mean, dtype=torch.float32)[None, :, None, None]
    std = torch.tensor(processor.image_std, dtype=torch.float32)[None, :, None, None]
    x = (x - mean) / std
    if pad := -n % temporal:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    t, gh, gw = x.shape[0] // temporal, rh // patch, rw // patch
    c = x.shape[1]
    x = x.reshape(t, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * gh * gw, c * temporal * patch * patch), [t, gh, gw]


def _resize(frame: np.ndarray, width: int, height: int, processor: Any) -> np.ndarray:
    from PIL import Image

    resample = getattr(processor, "resample", None)
    resample = Image.Resampling.BICUBIC if resample is None else Image.Resampling(int(resample))
    return np.asarray(Image.fromarray(frame).resize((width, height), resample=resample))


#: transformers' Qwen3VLVideoProcessor.size (shortest_edge / longest_edge): budgets over the
#: whole video (``t_bar * h * w``), not per frame
QWEN3_VIDEO_MIN_PIXELS = 128 * 32 * 32
QWEN3_VIDEO_MAX_PIXELS = 32 * 32 * 768


def qwen3_video_inputs(
    videos: list[Any],
    processor: Any,
    *,
    patch: int,
    merge: int,
    temporal: int,
    min_pixels: int = QWEN3_VIDEO_MIN_PIXELS,
    max_pixels: int = QWEN3_VIDEO_MAX_PIXELS,
) -> dict[str, torch.Tensor]:
    """``pixel_values_videos``/``video_grid_thw`` as transformers' ``Qwen3VLVideoProcessor``
    (``resize``, ``rescale_and_normalize``, ``patchify``; ``cap_pixels_per_frame`` off, its
    default) makes them: the frame size is its own ``smart_resize`` over all the video's frames
    (``min_pixels``/``max_pixels`` = its ``size.shortest_edge``/``longest_edge``); the frames,
    padded to the temporal patch by repeating the last one, are laid out as Qwen2-VL's. Its
    resize is torchvision's; frames are resized here with PIL (the resampler named by the image
    processor), so pixels may differ from it by resampling rounding, never in count or layout."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    rows, grids = [], []
    for v in videos:
        n, h, w, _ = v.frames.shape
        # its resize's call: the sampled (unpadded) frame count, factor patch * merge
        rh, rw = smart_resize(
            n,
            h,
            w,
            temporal_factor=temporal,
            factor=patch * merge,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
        )
        x, grid = _patches(v.frames, rh, rw, processor, patch=patch, merge=merge, temporal=temporal)
        rows.append(x)
        grids.append(grid)
    return {"pixel_values_videos": torch.cat(rows), "video_grid_thw": torch.tensor(grids, dtype=torch.long)}
