"""The one dtype rule, applied by core around every strategy call.

Parameters, gradients and optimizer state stay float32 (master weights) under
every strategy; ``train.dtype: bfloat16`` runs the forward (and so the
backward of what it saved) under ``torch.autocast``. Core's worker enters
:func:`compute_dtype` around ``encode``, ``loss_and_backward`` and
``evaluate``, so strategies do not cast or autocast on their own and a
comparison between layouts compares the same arithmetic.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def compute_dtype(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    """Autocast to ``dtype`` on ``device``, or nothing for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
