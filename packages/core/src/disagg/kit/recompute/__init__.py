"""Activation recomputation (``parallel.<module>.recompute``), applied by each strategy.

``full``: every transformer block keeps only its input; its forward runs again
in backward. ``selective``: only the attention core (scores, softmax, context)
is recomputed, as Megatron's selective recompute. Both are
``torch.utils.checkpoint`` (non-reentrant) at the places a strategy names: for
``full``, Hugging Face's own gradient-checkpointing layers
(``GradientCheckpointingLayer``: decoder layers, vision and audio blocks) get
:meth:`Recompute.checkpoint` as their checkpoint function, so module hooks stay
outside the replay as Transformers intends.

What torch's checkpoint already replays: the default generators (CPU and the
inputs' CUDA device) and the autocast state of the forward (the encoder
backward runs outside autocast, the replay inside it again). What it cannot
know and this module adds:

- a strategy's own dropout streams (:class:`~disagg.kit.recompute.rng.ShardRNG`)
  are snapshotted at the block's forward and replayed (``rngs``);
- a strategy's per-forward state (the ulysses runtime and its spanning
  segments, a sequence-parallel region's shape) is captured at the block's
  forward and re-entered around the replay (``captures``);
- :func:`replaying` tells code that counts a collective at forward time for
  its backward (Megatron's column linear) not to count it again;
- the replay's saved tensors are counted as the transient peak of the
  activation-bytes metric (the kept inputs are counted by the worker's saved-
  tensor hooks already: checkpoint saves them through them);
- ``offload``: under ``full``, each block's kept inputs live in host memory
  until its replay (``parallel.<module>.offload: activations | all``,
  :mod:`disagg.kit.recompute.offload`).

Early stop is off: the whole block is replayed, so a replay issues exactly the
block's forward collectives again and costs exactly one forward of FLOPs,
which is what the cost model charges.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from disagg.kit.recompute import activations
from disagg.kit.recompute.rng import ShardRNG

MODES: tuple[str, ...] = ("none", "full", "selective")

#: a capture is called at a checkpointed region's forward and returns a factory of
#: the context to re-enter around its replay (called once per replay)
Capture = Callable[[], Callable[[], contextlib.AbstractContextManager[Any]]]

_REPLAYING: ContextVar[bool] = ContextVar("disagg_recompute_replaying", default=False)


def replaying() -> bool:
    """True while a checkpointed region re-runs its forward during backward."""
    return _REPLAYING.get()


class _Replay(contextlib.AbstractContextManager):
    """Around a checkpointed region's replay: :func:`replaying` is true and ``enter``'s contexts
    are entered. Re-enterable: a replay may run more than once (``retain_graph``)."""

    def __init__(self, enter: Sequence[Callable[[], Any]] = ()) -> None:
        self.enter = list(enter)
        self._stacks: list[tuple[contextlib.ExitStack, Any]] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        token = _REPLAYING.set(True)
        try:
            for make in self.enter:
                stack.enter_context(make())
        except BaseException:
            stack.close()
            _REPLAYING.reset(token)
            raise
        self._stacks.append((stack, token))

    def __exit__(self, *exc: Any) -> None:
        stack, token = self._stacks.pop()
        try:
            stack.__exit__(*exc)
        finally:
            _REPLAYING.reset(token)


class Recompute:
    """One rank's recomputation for one module: its mode, the strategy's own
    dropout streams and the per-forward state its replay must see."""

    def __init__(
        self,
        mode: str = "none",
        rngs: Sequence[ShardRNG] = (),
        captures: Sequence[Capture] = (),
        offload: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"recompute {mode!r} is not one of: {', '.join(MODES)}")
        if offload and mode != "full":
            raise ValueError(
                f"offload: activations moves the inputs recompute: full keeps, but recompute is {mode!r}; "
                "allowed: recompute: full"
            )
        self.mode = mode
        #: the blocks' kept inputs in host memory between forward and replay
        self.offload = offload
        self.rngs = list(rngs)
        self.captures = list(captures)

    @property
    def full(self) -> bool:
        return self.mode == "full"

    @property
    def selective(self) -> bool:
        return self.mode == "selective"

    def checkpoint(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` keeping only its inputs; replayed in backward
        with the forward's random streams, autocast and captured state."""
        return self._checkpoint("", fn, *args, **kwargs)

    def tile(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """:meth:`checkpoint` for a region replayed inside a block's backward (one tile of its
        MLP, :mod:`disagg.kit.recompute.tiled_mlp`): its replay's saves are counted on top of
        the block's replayed ones."""
        return self._checkpoint("inner", fn, *args, **kwargs)

    def _checkpoint(self, scope: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)

        def context_fn() -> tuple[Any, Any]:
            # Called at the forward: what the replay must see again is read now.
            snaps = [(rng, rng.snapshot()) for rng in self.rngs]
            replays = [capture() for capture in self.captures]
            sink = activations.current_sink()
            enter: list[Callable[[], Any]] = [functools.partial(rng.replay, snap) for rng, snap in snaps]
            enter += replays
            if sink is not None:
                enter.append(functools.partial(sink.transient, scope))
            return contextlib.nullcontext(), _Replay(enter)

        return torch.utils.checkpoint.checkpoint(
            fn,
            *args,
            use_reentrant=False,
            context_fn=context_fn,
            preserve_rng_state=True,
            early_stop=False,
            **kwargs,
        )

    def block(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One transformer block under ``full`` (:meth:`checkpoint`), its kept inputs in host
        memory until the replay when ``offload`` is on."""
        if not self.offload or not torch.is_grad_enabled():
            return self._checkpoint("block", fn, *args, **kwargs)
        from disagg.kit.recompute.offload import OffloadedInputs

        with OffloadedInputs():
            return self._checkpoint("block", fn, *args, **kwargs)

    def attention(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """An attention core: checkpointed under ``selective``, run as is otherwise."""
        return self.checkpoint(fn, *args, **kwargs) if self.selective else fn(*args, **kwargs)

    def apply_full(self, module: nn.Module, what: str = "module") -> int:
        """Under ``full``, checkpoint every Hugging Face gradient-checkpointing
        layer of ``module`` with :meth:`block`; returns how many. Raises
        when the mode is ``full`` and ``module`` has none (nothing would be
        saved: refusing beats planning memory the run does not save)."""
        if not self.full:
            return 0
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = [m for m in module.modules() if isinstance(m, GradientCheckpointingLayer)]
        if not layers:
            raise ValueError(
                f"recompute: full, but {what} ({type(module).__name__}) has no Hugging Face "
                "gradient-checkpointing layers to recompute; allowed: none"
            )
        for layer in layers:
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = self.block  # type: ignore[assignment]
        return len(layers)
