"""The load-balanced causal split of a sequence over ``N`` context-parallel ranks.

The padded sequence is cut into ``2N`` equal chunks and rank ``i`` keeps chunks ``i`` and
``2N-1-i``: under a causal mask a late chunk attends to many more keys than an early one, and
pairing the ``i``-th earliest with the ``i``-th latest gives every rank the same attention work
(Megatron-LM's and torch's ``context_parallel`` round-robin layout). The split is an
``index_select`` along the sequence, so it is differentiable and gradients land back in place.
"""

from __future__ import annotations

import torch


def padded_length(tokens: int, n: int) -> int:
    """The sequence length padded up to a multiple of ``2n`` (``2n`` at least): each rank keeps
    two equal chunks, and a sample shorter than ``n`` still gives every rank its chunks."""
    step = 2 * n
    return max(step, -(-tokens // step) * step)


def local_positions(length: int, n: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions (ascending) of the tokens rank ``rank`` of ``n`` keeps of a sequence of
    ``length`` tokens (a multiple of ``2n``): chunk ``rank`` then chunk ``2n-1-rank``."""
    if length % (2 * n):
        raise ValueError(f"sequence length {length} is not a multiple of 2 x {n} context-parallel ranks")
    c = length // (2 * n)
    head = torch.arange(rank * c, (rank + 1) * c, device=device)
    tail = torch.arange((2 * n - 1 - rank) * c, (2 * n - rank) * c, device=device)
    return torch.cat([head, tail])


def gathered_order(length: int, n: int, device: torch.device | None = None) -> torch.Tensor:
    """For rows all-gathered from ranks ``0..n-1`` (each its :func:`local_positions`, in order):
    the row index holding each global position, so ``gathered[order]`` is in sequence order."""
    held = torch.cat([local_positions(length, n, r, device) for r in range(n)])
    return torch.argsort(held)


def split(x: torch.Tensor, dim: int, positions: torch.Tensor) -> torch.Tensor:
    """The rows of ``x`` along ``dim`` at ``positions`` (differentiable)."""
    return x.index_select(dim, positions.to(x.device))
