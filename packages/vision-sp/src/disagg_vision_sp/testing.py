"""Equivalence harness: ``ulysses`` ranks vs the single-process HF encoder.

Used by this package's tests and usable by end-to-end tests. The harness itself
is core's test kit (:mod:`disagg.testing.encoder`: the same samples and the same
upstream gradient on both sides, so outputs and parameter gradients must agree
to fp32 rounding); this module adds the images and runs it under ``ulysses``.
"""

from __future__ import annotations

from typing import Any

import torch

from disagg.interfaces import EncoderFamily
from disagg.testing.encoder import EncoderCase, assemble, run_encoder, upstream_grads
from disagg.testing.encoder import encoder_reference as reference
from disagg.testing.tolerance import assert_tensor_close, assert_tensors_close

__all__ = [
    "assemble",
    "assert_close",
    "assert_grads_close",
    "random_images",
    "reference",
    "run_ulysses",
    "upstream_grads",
]


def random_images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Any]:
    """Deterministic RGB PIL images of the given (width, height)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    out = []
    for w, h in sizes:
        arr = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
        out.append(Image.fromarray(arr.numpy(), "RGB"))
    return out


def run_ulysses(
    degree: int,
    replicas: int,
    family: EncoderFamily,
    inputs: list[dict[str, torch.Tensor]],
    grads: list[torch.Tensor],
) -> list[dict[str, Any]]:
    """``ulysses`` on ``degree * replicas`` gloo ranks (``disagg.testing.encoder``); results by rank:
    the shards each produced, the merged gradients (rank 0), the squared norm and all-to-all bytes."""
    from disagg_vision_sp.ulysses.strategy import UlyssesStrategy

    (results,) = run_encoder(UlyssesStrategy, degree, replicas, [EncoderCase(family, inputs, grads)])
    return results


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """fp32 equivalence of one tensor, by the project's policy (``disagg.testing.tolerance``): per
    element against the tensor's own scale."""
    assert_tensor_close(actual, expected, what)


def assert_grads_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """The same parameters have a gradient (a reference ``None`` must stay ``None``, never become
    zeros), and each is equal per element against its own scale (``disagg.testing.tolerance``).
    No floor borrowed from other tensors: a small tensor (a norm weight's gradient) is held to its
    own size."""
    assert_tensors_close(actual, expected, "grad ")
