"""Activation memory as a machine-independent count: the bytes autograd saves
for backward, weights excluded (they are model state, not activations).

Under activation recomputation (:mod:`disagg.kit.recompute`) what is
held is the checkpointed blocks' inputs (torch's checkpoint saves them through
the hooks active at the forward, so they are counted like any saved tensor)
and, during backward, one block's replay at a time: its saves go to torch's
recomputation hook, not to these, so the replay reports them to the sink that
was current at its forward (:meth:`SavedBytes.transient`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, Callable

import torch
from torch import nn

_SINK: ContextVar[SavedBytes | None] = ContextVar("disagg_saved_bytes", default=None)


def current_sink() -> SavedBytes | None:
    """The counter active around the current forward (None outside one)."""
    return _SINK.get()


class SavedBytes(contextlib.AbstractContextManager):
    """Saved-tensor hooks that call ``add(nbytes)`` for every tensor autograd
    saves while they are active, except ``module``'s parameters; a replay of a
    checkpointed block calls ``peak(nbytes)`` with what it held at once; a
    block whose kept inputs go to host memory (``offload: activations``,
    :mod:`disagg.kit.recompute.offload`) calls ``host(nbytes)`` for them
    instead of ``add``.

    The parameters' addresses are read at the first save, not when the hooks
    are made: a strategy may gather its parameters into new storage after the
    hooks are entered (ZeRO-3 does, for the whole call), and the gathered
    weights are still model state."""

    def __init__(
        self,
        module: nn.Module | None,
        add: Callable[[int], None],
        peak: Callable[[int], None] | None = None,
        host: Callable[[int], None] | None = None,
    ) -> None:
        self.module, self.add, self.peak, self.host = module, add, peak, host
        self._params: set[int] | None = None
        self._stack: list[tuple[Any, Any]] = []
        #: what the last recomputed block's replay saved (alive through that block's backward)
        self.block_replayed = 0

    def is_param(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter):
            return True
        if self._params is None:
            params = self.module.parameters() if self.module is not None else ()
            self._params = {p.data_ptr() for p in params}
        return t.data_ptr() in self._params

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not self.is_param(t):
            self.add(t.numel() * t.element_size())
        return t

    def offloaded(self, nbytes: int) -> None:
        """``nbytes`` saved in host memory instead of on the device."""
        if self.host is not None:
            self.host(nbytes)

    def __enter__(self) -> SavedBytes:
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, _identity)
        hooks.__enter__()
        self._stack.append((hooks, _SINK.set(self)))
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, token = self._stack.pop()
        _SINK.reset(token)
        hooks.__exit__(*exc)

    @contextlib.contextmanager
    def transient(self, scope: str = "") -> Iterator[None]:
        """Around one checkpointed region's replay: count what it saves (chained
        to torch's recomputation hook, which must still receive every save) and
        report it as a peak on top of what is held.

        ``scope``: ``block`` for a recomputed block, whose replayed saves stay alive
        while backward runs through the block; ``inner`` for a region replayed in
        that backward (a tile of the block's MLP, :mod:`disagg.kit.recompute.tiled_mlp`),
        whose peak is on top of its block's replayed saves too (the MLP is the block's
        last part, so its backward runs first, with every replayed save still held)."""
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        inner = top(False) if top is not None else None
        if inner is None or self.peak is None:
            yield
            return
        inner_pack, inner_unpack = inner
        held = 0

        def pack(t: torch.Tensor) -> Any:
            nonlocal held
            if not self.is_param(t):
                held += t.numel() * t.element_size()
            return inner_pack(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, inner_unpack):
            yield
        if scope == "block":
            self.block_replayed = held
        self.peak(held + (self.block_replayed if scope == "inner" else 0))


def saved_bytes_hooks(
    module: nn.Module | None,
    add: Callable[[int], None],
    peak: Callable[[int], None] | None = None,
    host: Callable[[int], None] | None = None,
) -> SavedBytes:
    """:class:`SavedBytes` (a context manager) for ``module``."""
    return SavedBytes(module, add, peak, host)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
