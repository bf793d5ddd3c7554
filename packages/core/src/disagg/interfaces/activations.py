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
    saves while they are active, except ``module``'s parameters.

    The parameters' addresses are read at the first save, not when the hooks
    are made: a strategy may gather its parameters into new storage after the
    hooks are entered (ZeRO-3 does, for the whole call), and the gathered
    weights are still model state."""
    params: set[int] | None = None

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal params
        if params is None:
            params = {p.data_ptr() for p in module.parameters()} if module is not None else set()
        if t.data_ptr() not in params:
            add(t.numel() * t.element_size())
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, _identity)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
