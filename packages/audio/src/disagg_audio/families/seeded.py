"""Tensors a family draws from a seed instead of reading them (a plain Whisper dir's
projector), served beside the dir's stored ones so that any slice can be read alone.

A rank that loads only its own slices (``megatron_tp``, :meth:`Family.stored_tensors`)
must get exactly the rows and columns ``build()`` would have drawn, without drawing the
whole tensor from one sequential stream. So each row of a drawn matrix has its own
generator, seeded from (seed, tensor name, row): reading rows ``[a, b)`` draws those rows
only, and the whole tensor is the same rows read together. ``build()`` reads through the
same object, so the single-process module and every rank's slices agree bit for bit by
construction, and no rank holds more than a block of rows of a tensor it does not keep.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from disagg.interfaces.stored import StoredTensors


@dataclass(frozen=True)
class Drawn:
    """One drawn tensor: a matrix of ``U(-bound, bound)`` elements, or zeros (``bound`` 0)."""

    shape: tuple[int, ...]
    bound: float = 0.0


def row_seed(seed: int, key: str, row: int) -> int:
    """The generator seed of row ``row`` of ``key``: distinct per (seed, tensor, row)."""
    digest = hashlib.blake2b(f"{seed}/{key}/{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes a non-negative int64


class SeededTensors(StoredTensors):
    """``path``'s stored tensors plus ``drawn`` ones (stored name -> :class:`Drawn`)."""

    def __init__(self, path: str | Path, drawn: dict[str, Drawn], seed: int) -> None:
        super().__init__(path)
        bad = [k for k, d in drawn.items() if d.bound and len(d.shape) != 2]
        if bad:
            raise ValueError(f"drawn tensors are matrices (drawn by row) or zeros: {bad}")
        self.drawn, self.seed = dict(drawn), int(seed)

    def __contains__(self, key: str) -> bool:
        return key in self.drawn or super().__contains__(key)

    def shape(self, key: str) -> list[int]:
        return list(self.drawn[key].shape) if key in self.drawn else super().shape(key)

    def read(
        self,
        key: str,
        index: tuple[slice, ...] = (),
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        if key not in self.drawn:
            return super().read(key, index, dtype, device)
        spec = self.drawn[key]
        rows = range(spec.shape[0])[index[0]] if index else range(spec.shape[0])
        if spec.bound == 0:
            piece = torch.zeros(spec.shape)[index] if index else torch.zeros(spec.shape)
        else:
            out = []
            for r in rows:
                g = torch.Generator().manual_seed(row_seed(self.seed, key, r))
                row = torch.empty(spec.shape[1:]).uniform_(-spec.bound, spec.bound, generator=g)
                out.append(row[index[1:]] if len(index) > 1 else row)
            cols = [*spec.shape[1:]]
            if len(index) > 1:
                cols = list(torch.empty(spec.shape[1:], device="meta")[index[1:]].shape)
            piece = torch.stack(out) if out else torch.empty([0, *cols])
        return piece.to(device=device, dtype=dtype or torch.float32)
