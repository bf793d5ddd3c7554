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

Attention modules (the layer map's ``heads``/``attention`` patterns) are forked,
and the stretch between a column linear's output and its row linear's input
that the layer map declares ``feature_split`` (Whisper's and Qwen2-Audio's
encoder layers drop activations between ``fc1`` and ``fc2`` with a functional
dropout in the layer's own forward, which no submodule wraps): there each TP
rank holds different features of the same shape, so a shared mask would drop
feature ``j`` and ``j + ffn/d`` together. The dropouts before and after act on
activations every TP rank holds whole and stay on the shared stream, or the
replicated residual stream would diverge across the ranks.

Under sequence parallelism the regions between the blocks hold different tokens on
each TP rank too; the families here have no dropout there (HF's Llama/Qwen2
decoders and the vision towers drop attention probabilities only), so nothing
draws in them. A family with hidden dropout under sequence parallelism would need
its layers forked as well.

Masks under head sharding cannot equal the single-process model's: HF draws one
mask for all heads from one stream, the TP ranks draw their heads' masks from
independent streams. At degree 1 nothing is forked and the masks are the
reference's bit for bit.
"""

from __future__ import annotations

import functools
from fnmatch import fnmatchcase

from torch import nn

from disagg.kit.recompute.rng import ShardRNG


def fork_around(module: nn.Module, patterns: tuple[str, ...] | list[str], rng: ShardRNG) -> list[str]:
    """Run the forward of every submodule named by ``patterns`` under
    ``rng.fork()``; returns the names wrapped."""
    wrapped = []
    for name, mod in module.named_modules():
        if name and any(fnmatchcase(name, p) for p in patterns):
            mod.forward = functools.partial(_forked_forward, mod.forward, rng)  # type: ignore[method-assign]
            wrapped.append(name)
    return wrapped


def fork_between(module: nn.Module, regions: dict[str, tuple[str, str]], rng: ShardRNG) -> list[str]:
    """For each layer named by a ``regions`` pattern, draw from ``rng`` from the end of its
    ``first`` child's forward to the start of its ``last`` child's (the layer map's
    ``feature_split``); returns the layers wrapped. A layer whose forward ends (or raises)
    inside the stretch leaves it there: the default stream is never left swapped."""
    names = dict(module.named_modules())
    wrapped = []
    for pattern, (first, last) in regions.items():
        # fnmatch's ``*`` crosses dots: a layer is a match that holds both children
        layers = [
            n
            for n in names
            if n and fnmatchcase(n, pattern) and f"{n}.{first}" in names and f"{n}.{last}" in names
        ]
        if not layers:
            raise ValueError(
                f"layer map feature_split {pattern!r}: no layer holds both {first!r} and {last!r}"
            )
        for name in layers:
            region = _Stretch(rng)
            names[f"{name}.{first}"].register_forward_hook(region.enter)
            names[f"{name}.{last}"].register_forward_pre_hook(region.leave)
            layer = names[name]
            layer.forward = functools.partial(_stretched_forward, layer.forward, region)  # type: ignore[method-assign]
            wrapped.append(name)
    return wrapped


class _Stretch:
    """``rng.fork()`` entered and left by two hooks of one layer's forward."""

    def __init__(self, rng: ShardRNG) -> None:
        self.rng, self.fork = rng, None

    def enter(self, *_hook_args: object) -> None:
        if self.fork is None:
            self.fork = self.rng.fork()
            self.fork.__enter__()

    def leave(self, *_hook_args: object) -> None:
        if self.fork is not None:
            fork, self.fork = self.fork, None
            fork.__exit__(None, None, None)


def _stretched_forward(forward, region: _Stretch, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
    try:
        return forward(*args, **kwargs)
    finally:
        region.leave()


def _forked_forward(forward, rng: ShardRNG, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
    with rng.fork():
        return forward(*args, **kwargs)
