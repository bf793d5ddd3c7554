"""Dropout in a ulysses forward: one RNG stream per (replica, shard).

Every activation of a ulysses forward differs across the ranks of a replica:
outside the all-to-all a rank holds its own tokens, inside it a head shard of
the whole sequence. Drawn from the default generator (core reseeds it per
replica, the same state on every rank of the replica), two ranks would give
their tokens or heads identical masks whenever the shapes agree, e.g. the
attention probabilities of heads ``i`` and ``i + h/d`` of an image would
always be dropped together. The forward therefore draws from a stream seeded
by ``dropout_seed(seed, replica, shard)`` (Megatron's model-parallel RNG
tracker idea; megatron's own tracker forks CUDA generator state only).

Masks cannot equal the single-process encoder's: HF draws one mask over all
heads and tokens of a batch of images from one stream, here each rank draws
those of its heads (or tokens) of the concatenated sequence from its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class ShardRNG:
    """A generator state of its own on ``device``, swapped in by :meth:`fork`."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = torch.device(device)
        self._active = False
        with torch.random.fork_rng(devices=self._cuda_devices()):
            if self.device.type == "cuda":
                torch.cuda.manual_seed(seed)
            else:
                torch.manual_seed(seed)
            self.state = self._get()

    def _cuda_devices(self) -> list[int]:
        return [self.device.index or 0] if self.device.type == "cuda" else []

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Draw from this stream inside; the default stream is left where it was."""
        if self._active:  # nested regions share the one stream
            yield
            return
        saved = self._get()
        self._set(self.state)
        self._active = True
        try:
            yield
        finally:
            self._active = False
            self.state = self._get()
            self._set(saved)
