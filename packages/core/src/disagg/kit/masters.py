"""The ``bf16`` and ``bf16-pure`` recipes on a rank's module (:mod:`disagg.interfaces.precision`).

``bf16-pure``: every floating parameter becomes bf16 and stays so; AdamW (which follows the
parameter's dtype) keeps bf16 moments, gradients accumulate and are summed in bf16.

``bf16``: every floating parameter becomes bf16 for compute, and each *trainable* one keeps a
float32 master. Nothing autocasts: the forward runs on the bf16 weights (bf16 activations and
residual stream, no weight copies saved for backward). Each microbatch's bf16 gradient is added
into a float32 buffer as soon as autograd has accumulated it (a post-accumulate-grad hook) and
freed, so gradients accumulate over microbatches in float32.

The masters are not separate parameters: they are the *same* ``nn.Parameter`` objects seen in
float32. :meth:`MasterWeights.view` points every trainable parameter's ``.data`` at its float32
master and its ``.grad`` at the float32 buffer (as FSDP1's mixed precision swaps ``.data``), and
back to the bf16 weight afterwards. Inside the view the module *is* the float32 module: the
group's reduction, the global grad norm, clipping, AdamW (float32 moments), ZeRO-1's broadcasts,
the checkpoint's full form (float32 masters) and a load all run unchanged on the parameter
objects they already know, with their names and the attributes strategies set on them
(``tp_spec``, megatron's ``sequence_parallel``, ...).

The masters live in the optimizer: :class:`MasterOptimizer` wraps the one a strategy builds
over the masters and, as Megatron's mixed-precision optimizer and FSDP2's policy do, steps the
float32 copies and writes the bf16 weights back (its ``step`` and ``zero_grad`` run in the
view). What else reads or writes the masters says so where it is written: a method of the
kit's defaults that reduces, measures, clips or saves the state runs in the view through
:func:`in_master_view` (``write=True``: it writes the masters, e.g. a load, and every master
is copied into its bf16 weight on leaving; after any other, those whose version counter
moved). A strategy's own override of such a method is called as written; it enters the view
with the same decorator or :meth:`~disagg.kit.roles.Parallelizer.masters` where it touches
gradients or state. (The version counter alone would miss writes through ``.data``:
``ZeroRedundancyOptimizer`` broadcasts into ``param.data``, inside the wrapper's step.)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from disagg.interfaces.precision import Recipe

F = TypeVar("F", bound=Callable[..., Any])


def in_master_view(write: bool = False) -> Callable[[F], F]:
    """Run the decorated strategy method with its parameters seen as their float32 masters
    (``self.masters(write)``; nothing under ``fp32`` and ``bf16-pure``). ``write``: the method
    writes the masters (a load), so every bf16 weight is refreshed on leaving."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self.masters(write):
                return fn(self, *args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


def cast_floating(module: nn.Module, dtype: torch.dtype) -> None:
    """Every floating parameter of ``module`` in ``dtype``, in place (buffers keep theirs: Hugging
    Face computes e.g. rotary frequencies in float32 whatever the weights' dtype)."""
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


class MasterWeights:
    """Float32 masters and gradient buffers of a bf16 module's trainable parameters."""

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype) -> None:
        self.params = [p for p in params if p.is_floating_point()]
        #: float32, what AdamW steps; the parameters hold these inside :meth:`view`
        self.masters = [self._master_of(p) for p in self.params]
        #: the bf16 weights the forward and backward use; the parameters hold these outside it
        self.weights = [self._weight_of(p, m, dtype) for p, m in zip(self.params, self.masters)]
        #: float32 gradient sums of this step (None: no gradient yet)
        self.grads: list[torch.Tensor | None] = [None] * len(self.params)
        self._depth = 0
        self._write = False
        self._versions = [p._version for p in self.params]
        for i, p in enumerate(self.params):
            p.data = self.weights[i]
            p.register_post_accumulate_grad_hook(self._accumulate(i))

    def _master_of(self, p: torch.Tensor) -> torch.Tensor:
        """The master copy of parameter ``p`` (:mod:`disagg.kit.offload` places it in host memory)."""
        return p.detach().float()

    def _weight_of(self, p: torch.Tensor, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The working weight the forward uses, from its ``master``."""
        return master.to(dtype)

    def _accumulate(self, i: int):  # type: ignore[no-untyped-def]
        def hook(p: torch.Tensor) -> None:
            if self._depth:  # a backward inside the view (none in a step): float32 already
                return
            g = p.grad
            if g is None:
                return
            if self.grads[i] is None:
                self.grads[i] = g.float() if g.dtype != torch.float32 else g.clone()
            else:
                self.grads[i].add_(g)  # type: ignore[union-attr]
            p.grad = None  # the bf16 gradient lives only until it is added here

        return hook

    @contextlib.contextmanager
    def view(self, write: bool = False) -> Iterator[None]:
        """The parameters as their float32 masters with the float32 gradient sums (reentrant);
        ``write``: the masters will be written (all are copied into the weights on leaving)."""
        self._write = self._write or write
        if self._depth == 0:
            for i, p in enumerate(self.params):
                if p.grad is not None:  # a bf16 gradient the hook did not see: never drop it
                    self._accumulate(i)(p)
                p.data = self.masters[i]
                p.grad = self.grads[i]
            self._versions = [p._version for p in self.params]
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._leave()

    def _leave(self) -> None:
        written = []
        for i, p in enumerate(self.params):
            g = p.grad  # the view may have replaced, scaled or dropped it (zero_grad)
            self.grads[i] = g
            p.grad = None
            if p.data is not self.masters[i]:  # e.g. a load that assigned a new tensor
                self.masters[i] = p.data
            p.data = self.weights[i]
            if self._write or p._version != self._versions[i]:
                written.append(i)
        self._write = False
        if written:
            self._sync(written)

    def _sync(self, which: list[int]) -> None:
        with torch.no_grad():
            torch._foreach_copy_([self.weights[i] for i in which], [self.masters[i] for i in which])
        self._versions = [p._version for p in self.params]

    def refresh(self) -> None:
        """Copy every master into its bf16 weight: after a sharded checkpoint's reader filled
        the masters in place, once ``sharded_state`` had returned (through whatever alias)."""
        self._sync(list(range(len(self.params))))

    def weight_bytes(self) -> int:
        """The bf16 weights' bytes (inside :meth:`view` the parameters count as the masters)."""
        return sum(w.numel() * w.element_size() for w in self.weights)


def apply_recipe(module: nn.Module, recipe: Recipe) -> MasterWeights | None:
    """``module`` (parallelized, trainable parameters decided) in ``recipe``'s weights; under a
    recipe with masters, the :class:`MasterWeights` of its trainable parameters."""
    if recipe.weights == torch.float32:
        return None
    trainable = [p for p in module.parameters() if p.requires_grad] if recipe.master is not None else []
    masters = MasterWeights(trainable, recipe.weights) if trainable else None
    cast_floating(module, recipe.weights)  # frozen parameters too: no master, bf16 weights only
    return masters


def cast_inputs(inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """An encoder's preprocessed inputs with floating tensors (pixels, audio features) in the
    compute dtype, as a module with ``dtype`` weights needs them; ids, grids, masks unchanged."""
    if dtype == torch.float32:
        return inputs
    return {
        k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() and v.dtype != dtype else v
        for k, v in inputs.items()
    }


class MasterOptimizer:
    """The optimizer of a ``bf16`` module: ``inner`` (built over the parameters seen as their
    float32 masters: AdamW, ZeRO-1, a strategy's own) steps the masters, and the bf16 weights
    the forward uses are written back after each step. Everything else (``param_groups``,
    ``state``, ``state_dict``, a ZeRO-1 ``consolidate_state_dict``...) is ``inner``'s; an LR
    scheduler drives ``inner`` (torch's schedulers accept only a ``torch.optim.Optimizer``)."""

    def __init__(self, inner: Any, masters: MasterWeights) -> None:
        self.inner = inner
        self.masters = masters

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        with self.masters.view(write=True):
            return self.inner.step(closure) if closure is not None else self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        with self.masters.view():  # the float32 gradient sums are the ones to clear
            self.inner.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        # only reached for what this class does not define: the inner optimizer's
        return getattr(self.__dict__["inner"], name)
