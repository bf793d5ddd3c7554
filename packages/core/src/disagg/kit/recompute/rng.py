"""One dropout stream per shard of a replica, swapped in around a region.

Core reseeds the default generator per replica (``dropout_seed(seed, replica)``),
so every rank of a replica draws the same masks from it. Where the ranks of a
replica hold *different* activations of the same shape (a head shard under
tensor parallelism, a token or head shard under sequence parallelism), those
identical masks would correlate: heads ``i`` and ``i + h/d`` always dropped
together. A strategy forks a stream seeded with
``dropout_seed(seed, replica, shard)`` around such regions; this is Megatron's
model-parallel RNG tracker idea. Megatron's own ``CudaRNGStatesTracker`` swaps
``torch.cuda`` generator states only, so on the CPU dropout would keep drawing
from the default generator; :class:`ShardRNG` swaps the generator of the
module's own device (CPU or CUDA), so the same code runs on both.

It lives here, not in a plugin, because several strategies need it and plugins
must not import each other.
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

    # -- activation recomputation (disagg.kit.recompute) ---------------------------------------
    def snapshot(self) -> tuple[torch.Tensor | None, bool]:
        """Where the stream stands at a checkpointed forward, for :meth:`replay`.
        Inside :meth:`fork` the default generator *is* this stream (torch's
        checkpoint restores it for the replay), so only that fact is kept."""
        return (None, True) if self._active else (self.state.clone(), False)

    @contextlib.contextmanager
    def replay(self, snap: tuple[torch.Tensor | None, bool]) -> Iterator[None]:
        """Re-run a checkpointed forward drawing the masks it drew: from the
        snapshot, leaving the stream where the later forwards left it."""
        state, active = snap
        if active:
            # The forward ran inside fork(): nested forks of the replay must not
            # swap the (already restored) default generator for the advanced stream.
            was, self._active = self._active, True
            try:
                yield
            finally:
                self._active = was
            return
        current, self.state = self.state, state.clone()  # type: ignore[union-attr]
        try:
            yield
        finally:
            self.state = current
