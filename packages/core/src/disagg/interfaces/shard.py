"""What crosses from an encoder rank to the language model, and back."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EmbeddingShard:
    """One encoder rank's part of one sample's output embeddings.

    ``positions`` index the rows of the sample's full embedding sequence (in
    the order the language model consumes placeholders), so a strategy may cut
    and reorder tokens however it likes (Ulysses shards, Qwen2.5-VL window
    permutation) and the receiver still assembles the sample exactly. The
    gradient that comes back for this shard has the shape of ``value`` and the
    same row order. An empty shard (zero rows) is legal.
    """

    positions: torch.Tensor  # int64 [n_local]
    value: torch.Tensor  # [n_local, hidden]
    total: int  # rows of the full sample embedding, so the receiver can allocate it

    @staticmethod
    def whole(value: torch.Tensor) -> EmbeddingShard:
        return EmbeddingShard(torch.arange(value.shape[0]), value, value.shape[0])

    @staticmethod
    def empty(total: int, hidden: int, like: torch.Tensor | None = None) -> EmbeddingShard:
        """Zero rows, with the device and dtype of ``like`` (the rank's own output): on a GPU
        transport a CPU tensor beside the other ranks' CUDA ones would not cross. Positions stay
        on the CPU, as :meth:`whole`'s do."""
        dtype = like.dtype if like is not None else torch.float32
        device = like.device if like is not None else None
        value = torch.zeros(0, hidden, dtype=dtype, device=device)
        return EmbeddingShard(torch.zeros(0, dtype=torch.long), value, total)
