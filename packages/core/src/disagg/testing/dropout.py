"""Dropout-mask capture: what each active dropout call kept, for the tests that
check masks match the reference where ranks hold the same activations."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def dropout_spy() -> Iterator[list[torch.Tensor]]:
    """Record the mask of every active ``torch.nn.functional.dropout`` call (which HF's
    eager attention calls on the attention probabilities): 1 kept, 0 dropped, -1 where
    the input was already zero (causal and padding zeros, which no mask can tell apart)."""
    masks: list[torch.Tensor] = []
    real = F.dropout

    def spy(x, p=0.5, training=True, inplace=False):  # noqa: ANN001, ANN202
        out = real(x, p, training, inplace)
        if training and p > 0:
            masks.append(torch.where(x.detach() != 0, (out.detach() != 0).to(torch.int8), -1))
        return out

    F.dropout = spy
    try:
        yield masks
    finally:
        F.dropout = real
