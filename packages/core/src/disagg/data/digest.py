"""A digest of a sample's media as its encoder receives them: the content part of a
feature cache key (:mod:`disagg.runtime.feature_key`), computed where the sample is
preprocessed so that the driver, which never sees tensors, can look it up."""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def inputs_digest(inputs: dict[str, Any]) -> str:
    """sha256 over an encoder's input dict: each entry's name, dtype, shape and bytes, in
    name order (so two samples with the same pixels and grid, whatever their file names,
    share it; a different resize under ``data.max_pixels`` changes it)."""
    h = hashlib.sha256()
    for name in sorted(inputs):
        x = inputs[name]
        h.update(name.encode())
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(x).encode())
    return h.hexdigest()
