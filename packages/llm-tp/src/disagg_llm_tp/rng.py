"""Dropout inside tensor-parallel regions: one RNG stream per (replica, TP rank).

Core reseeds the default generator per replica after set-up
(``dropout_seed(seed, replica)``), so the TP ranks of one replica draw the same
masks on activations they all hold (hidden states between the blocks). Inside
an attention module the activations are a head shard: rank 0's attention
probabilities are those of heads 0..h/d-1, rank 1's of the next heads. Drawn
from the shared default stream, every TP rank would give its heads the same
mask (identical shapes, identical state), so head ``i`` and head ``i + h/d``
would always be dropped together. Megatron forks a model-parallel RNG state,
seeded per TP rank, around such regions (``get_cuda_rng_tracker().fork()``);
this is the same idea.

Why not megatron's tracker itself: ``CudaRNGStatesTracker`` saves and swaps
``torch.cuda`` generator states only (``torch.cuda.get_rng_state``), so on the
CPU it fails at ``add`` and dropout would keep drawing from the default CPU
generator. :class:`ShardRNG` swaps the generator of the module's own device
(CPU or CUDA), so the same code runs on both.

Only attention modules (the layer map's ``heads``/``attention`` patterns) are
forked. Under sequence parallelism the regions between the blocks hold
different tokens on each TP rank too; the families here have no dropout there
(HF's Llama/Qwen2 decoders and the vision towers drop attention probabilities
only), so nothing draws in them. A family with hidden dropout under sequence
parallelism would need its layers forked as well.

Masks under head sharding cannot equal the single-process model's: HF draws
one mask for all heads from one stream, the TP ranks draw their heads' masks
from independent streams. At degree 1 nothing is forked and the masks are the
reference's bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from fnmatch import fnmatchcase

import torch
from torch import nn


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


def fork_around(module: nn.Module, patterns: tuple[str, ...] | list[str], rng: ShardRNG) -> list[str]:
    """Run the forward of every submodule named by ``patterns`` under
    ``rng.fork()``; returns the names wrapped."""
    wrapped = []
    for name, mod in module.named_modules():
        if name and any(fnmatchcase(name, p) for p in patterns):
            mod.forward = functools.partial(_forked_forward, mod.forward, rng)  # type: ignore[method-assign]
            wrapped.append(name)
    return wrapped


def _forked_forward(forward, rng: ShardRNG, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
    with rng.fork():
        return forward(*args, **kwargs)
