"""Activation memory as a machine-independent count: the bytes autograd saves
for backward, weights excluded (they are model state, not activations)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def saved_bytes_hooks(
    module: nn.Module | None, add: Callable[[int], None]
) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that call ``add(nbytes)`` for every tensor autograd
    saves while they are active, except ``module``'s parameters."""
    params = {p.data_ptr() for p in module.parameters()} if module is not None else set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            add(t.numel() * t.element_size())
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, _identity)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
