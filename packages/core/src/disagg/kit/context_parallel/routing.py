"""Which encoder rows each context-parallel rank needs, and their gradients back.

A rank of the split keeps only the tokens at its :func:`~.split.local_positions`, so of an
encoder output it needs only the rows scattered at those tokens: an image whose placeholders
straddle a boundary goes to both ranks, each getting the rows of its own chunks. Every token is
held by exactly one rank, so every row goes to exactly one rank and its gradient is computed
whole there (the rows of other ranks' tokens never enter this rank's forward); back at the
encoder rank the parts are put in place, each row exactly once (:func:`place_grads`).

Where the rows go is read from the family's own ``scatter`` (a probe of row numbers scattered
the way the forward scatters embeddings), so a family that orders rows its own way (images
then videos, Qwen2.5-VL) routes them as its forward places them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from disagg.kit.context_parallel.split import local_positions, padded_length

#: per context-parallel rank: sample id -> module -> the encoder rows (global row numbers)
RankRows = list[dict[int, dict[str, torch.Tensor]]]


def row_tokens(family: Any, ids: torch.Tensor, module: str, total: int) -> torch.Tensor:
    """Token position of each of the ``total`` rows of ``module`` the family scatters into the
    sample ``ids`` (1-D), as its forward does."""
    scatter = getattr(family, "scatter", None)
    if scatter is None:
        raise TypeError(f"family {type(family).__name__} has no scatter(): cannot route its rows per rank")
    probe = torch.arange(1, total + 1, dtype=torch.float64)[:, None]
    placed = scatter(torch.zeros(1, ids.numel(), 1, dtype=torch.float64), ids[None], [{module: probe}])
    placed = placed[0, :, 0]
    where = placed.nonzero().flatten()
    if where.numel() != total:
        raise ValueError(f"{module!r}: {where.numel()} placeholder tokens for {total} encoder rows")
    tokens = torch.empty(total, dtype=torch.long)
    tokens[placed[where].long() - 1] = where
    return tokens


def rows_per_rank(
    family: Any,
    sample_ids: Sequence[int],
    inputs: Sequence[dict[str, torch.Tensor]],
    totals: dict[int, dict[str, int]],
    n: int,
) -> RankRows:
    """For each of ``n`` ranks, the rows of each sample's encoder outputs (``totals``: sample id
    -> module -> rows) whose tokens it holds, for the microbatch ``inputs`` padded as the
    forward pads it (the longest sample, to a multiple of ``2n``)."""
    out: RankRows = [{} for _ in range(n)]
    if not inputs:
        return out
    length = padded_length(max(int(x["input_ids"].numel()) for x in inputs), n)
    owner = torch.empty(length, dtype=torch.long)
    for r in range(n):
        owner[local_positions(length, n, r)] = r
    for sid, x in zip(sample_ids, inputs):
        ids = x["input_ids"].reshape(-1).cpu()
        for module, total in totals.get(sid, {}).items():
            rank_of_row = owner[row_tokens(family, ids, module, total)]
            for r in range(n):
                out[r].setdefault(sid, {})[module] = (rank_of_row == r).nonzero().flatten()
    return out


def select(positions: torch.Tensor, wanted: torch.Tensor | None) -> torch.Tensor:
    """Which of an encoder shard's rows (its global row numbers ``positions``) a rank wants: a
    boolean mask (all of them when ``wanted`` is None)."""
    if wanted is None:
        return torch.ones(positions.numel(), dtype=torch.bool, device=positions.device)
    return torch.isin(positions, wanted.to(positions.device))


def place_grads(
    positions: torch.Tensor, like: torch.Tensor, parts: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """The gradient of an encoder shard (global rows ``positions``, values ``like``) from the
    parts that came back, each ``(global rows, their gradients)``: every row must come back
    exactly once (a row missing or summed twice is an error, not a silent wrong gradient)."""
    out = torch.zeros_like(like)
    count = torch.zeros(positions.numel(), dtype=torch.long, device=positions.device)
    order = torch.argsort(positions)
    ranked = positions[order]
    for rows, grad in parts:
        rows = rows.to(positions.device)
        at = torch.searchsorted(ranked, rows).clamp(max=max(ranked.numel() - 1, 0))
        if rows.numel() and not torch.equal(ranked[at], rows):
            raise RuntimeError("gradients came back for encoder rows this rank does not hold")
        idx = order[at]
        out.index_add_(0, idx.to(out.device), grad.to(out.device, out.dtype))
        count.index_add_(0, idx, torch.ones_like(idx))
    if bool((count != 1).any()):
        bad = positions[count != 1].tolist()[:8]
        times = count[count != 1].tolist()[:8]
        raise RuntimeError(f"encoder rows {bad} came back {times} times: each must come back once")
    return out
