"""The run's precision recipe (``train.precision``): one rule for every module and strategy.

Three recipes, each a fixed set of dtypes for what a rank holds, so that the runtime,
the cost model and the tests read the same table (:data:`RECIPES`):

- ``fp32``: weights, gradients and AdamW state in float32; the forward in float32.
- ``bf16``: the module's weights in bfloat16 for compute (so activations and the residual
  stream are bf16 and no autocast copy of a weight is saved for backward), a float32
  master copy of each weight that the optimizer steps, gradients accumulated and reduced
  in float32, AdamW moments in float32: the Megatron / FSDP mixed-precision standard.
- ``bf16-pure``: weights, gradients and AdamW moments all bfloat16, no master copy (the
  published DHP run's recipe): half the state of ``bf16``, at the cost of updates smaller
  than a weight's bf16 spacing (about 2^-8 of its magnitude) being rounded away.

``auto`` resolves to ``fp32`` on CPU and ``bf16`` on CUDA (:func:`resolve_precision`).

:func:`compute_dtype` is the older rule, kept for callers that autocast a float32 module
(evaluation references in tests); the recipes do not autocast.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

#: values of ``train.precision``
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16", "bf16-pure")


@dataclass(frozen=True)
class Recipe:
    """The dtypes one rank holds its module's state and activations in."""

    name: str
    #: the module's weights as the forward and backward use them (and so its activations)
    weights: torch.dtype
    #: a separate master copy of each trainable weight that the optimizer steps;
    #: None: the weights are stepped in place
    master: torch.dtype | None
    #: gradients as accumulated over microbatches and summed over the group
    grads: torch.dtype
    #: AdamW's exp_avg and exp_avg_sq
    moments: torch.dtype

    @property
    def activation_bytes(self) -> int:
        """Bytes per saved activation element (the compute dtype's)."""
        return self.weights.itemsize

    @property
    def master_bytes(self) -> int:
        """Bytes of an element's master copy (0 without one)."""
        return self.master.itemsize if self.master is not None else 0

    def state_bytes_per_element(self, trainable: bool = True) -> int:
        """Bytes one parameter element costs on the rank that holds it: its weight, and if it
        trains, its master copy, gradient and two AdamW moments (a frozen one: weight only)."""
        if not trainable:
            return self.weights.itemsize
        return self.weights.itemsize + self.master_bytes + self.grads.itemsize + 2 * self.moments.itemsize


RECIPES: dict[str, Recipe] = {
    "fp32": Recipe("fp32", torch.float32, None, torch.float32, torch.float32),  # 16 B/param
    "bf16": Recipe("bf16", torch.bfloat16, torch.float32, torch.float32, torch.float32),  # 18 B/param
    "bf16-pure": Recipe("bf16-pure", torch.bfloat16, None, torch.bfloat16, torch.bfloat16),  # 8 B/param
}


def resolve_precision(name: str, device_type: str) -> Recipe:
    """The recipe ``train.precision: name`` means on ``device_type`` (``cpu`` / ``cuda``)."""
    if name == "auto":
        name = "bf16" if device_type == "cuda" else "fp32"
    if name not in RECIPES:
        raise ValueError(f"unknown precision {name!r}; allowed: {', '.join(PRECISIONS)}")
    return RECIPES[name]


def compute_dtype(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    """Autocast to ``dtype`` on ``device``, or nothing for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
