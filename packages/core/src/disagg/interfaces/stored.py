"""The tensors of a Hugging Face dir, read by name without loading the checkpoint
(what :meth:`disagg.interfaces.Family.stored_tensors` returns)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class StoredTensors:
    """The tensors of an HF dir's safetensors files by stored name, read whole or
    as slices (``safe_open(...).get_slice``) in the dtype and onto the device asked.

    Each read opens its file and closes it after: the file is memory-mapped, and
    the pages a slice touches count in this process's resident memory until it is
    unmapped, so a rank that kept the files open would end up holding its share
    of the whole checkpoint besides its own tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            self.files = {k: self.path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            from safetensors import safe_open

            self.files = {}
            for f in sorted(self.path.glob("*.safetensors")):
                with safe_open(str(f), "pt") as st:
                    self.files.update({k: f for k in st.keys()})

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def shape(self, key: str) -> list[int]:
        from safetensors import safe_open

        with safe_open(str(self._file(key)), "pt") as st:
            return list(st.get_slice(key).get_shape())

    def read(
        self,
        key: str,
        index: tuple[slice, ...] = (),
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """Tensor ``key`` (``index``: only those slices of it, e.g. ``(slice(0, 8),)``
        for its first 8 rows), cast to ``dtype`` (None: as stored)."""
        from safetensors import safe_open

        with safe_open(str(self._file(key)), "pt") as st:
            piece = st.get_slice(key)[index] if index else st.get_tensor(key)
        return piece.to(device=device, dtype=dtype or piece.dtype)

    def _file(self, key: str) -> Path:
        if key not in self.files:
            raise KeyError(f"{self.path} stores no tensor {key!r}")
        return self.files[key]
