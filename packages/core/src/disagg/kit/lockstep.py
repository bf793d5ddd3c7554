"""Lockstep: every rank of a group makes the same collectives, whatever its share of the samples.

A strategy that shards parameters gathers them around the module's calls (FSDP2 per unit,
DeepSpeed's ZeRO-3 per submodule) and reduces their gradients in the calls' backward: those
are collectives, issued in the order of the calls, and the calls follow the data. So a rank
with fewer calls than another (fewer samples, none included) makes **placeholder calls**
whose output gradient is zero: they issue the same collectives and add exact zeros.

One mechanism, three ways for the ranks to agree on how many calls each makes:

- *known*: every rank makes ``n`` calls by construction (``ulysses``: one forward per replica and
  microbatch, so only an empty replica pads, to one) -- :meth:`Lockstep.pad` alone;
- *counted*: the ranks agree on the most calls with one small all-reduce first
  (:func:`agreed_max`; ``ddp`` under FSDP2, ``zero``'s LLM samples and loss chunks,
  :func:`padded_spans`);
- *voted*: a family's ``encode`` makes a data-dependent number of root-module calls per input,
  so the ranks vote before each root call (:class:`RootCalls`; ``zero``'s encoder under ZeRO-3).

The placeholder input is the family's: :func:`placeholder_input` (one black image through its
``preprocess``) for an encoder, :func:`placeholder_sample` (one token without a label) for a
language model. :class:`Lockstep` keeps, per microbatch, the outputs of this rank's placeholder
calls until :meth:`Lockstep.zero_seeds` hands them to backward with zero gradients, or
:meth:`Lockstep.release` drops them (evaluation, a frozen module).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disagg.interfaces.comm import CommCounter

__all__ = [
    "Lockstep",
    "RootCalls",
    "agreed_max",
    "grad_tensors",
    "padded_spans",
    "placeholder_input",
    "placeholder_sample",
    "without_dropout",
]


def placeholder_input(family: Any, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """One black image, preprocessed by the family (what a rank without samples forwards), its
    pixels in the compute dtype ``dtype`` as the worker casts real inputs."""
    from PIL import Image

    from disagg.kit.masters import cast_inputs

    return cast_inputs(family.preprocess([Image.new("RGB", (28, 28))]), dtype)


def placeholder_sample(family: Any) -> dict[str, torch.Tensor]:
    """A one-token text sample without a label: no loss, so a gradient of exact zeros, and
    no encoder rows. The token is 0, or 1 where 0 is a placeholder token of some module."""
    taken = set()
    for m in ("vision", "audio"):
        try:
            taken.add(int(family.placeholder_token_id(m)))
        except Exception:  # noqa: BLE001 - a family without that module has no such token
            pass
    token = next(t for t in range(len(taken) + 1) if t not in taken)
    return {"input_ids": torch.tensor([token]), "labels": torch.tensor([-100])}


def agreed_max(n: int, device: torch.device, comm: CommCounter | None = None) -> int:
    """The largest ``n`` over the default group, in one small all-reduce. Through ``comm``
    (which counts it; it sums only): every rank's count as a one-hot vector. Without: one
    int64 under ``MAX``, counted by the caller's wrapper of ``torch.distributed`` (``zero``'s,
    whose engine calls ``torch.distributed`` itself)."""
    if comm is None:
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)
    counts = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    counts[dist.get_rank()] = n
    comm.all_reduce(counts)
    return int(counts.max())


def padded_spans(tokens: int, chunk: int | None, device: torch.device) -> list[tuple[int, int]]:
    """This rank's loss chunks ``[start, end)`` over ``tokens`` rows, padded with empty ones
    to the group's most (one small all-reduce)."""
    from disagg.kit.chunked_loss import bounds

    spans = bounds(tokens, chunk)
    k = agreed_max(len(spans), device)
    return spans + [(tokens, tokens)] * (k - len(spans))


def grad_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a module's output (tensor, tuple, dict, Hugging Face output) that
    require a gradient."""
    if torch.is_tensor(out):
        return [out] if out.requires_grad else []
    if isinstance(out, dict):
        out = list(out.values())
    elif hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (list, tuple)):
        return [t for x in out for t in grad_tensors(x)]
    return []


@contextlib.contextmanager
def without_dropout(module: nn.Module) -> Iterator[None]:
    """A placeholder's forward inside draws no dropout mask: every submodule in eval mode but
    Hugging Face's gradient-checkpointing layers, whose train mode decides whether they are
    recomputed (the group's gathers follow that). Its gradient is zero whatever the masks; a
    rank without samples draws nothing, and its random stream stays put."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    flipped = [m for m in module.modules() if m.training and not isinstance(m, GradientCheckpointingLayer)]
    for m in flipped:
        m.training = False
    try:
        yield
    finally:
        for m in flipped:
            m.training = True


class Lockstep:
    """One rank's placeholder calls, per microbatch: the placeholder input (made once), the
    padding of a call list to the group's count, and the outputs kept for their zero-gradient
    backward."""

    def __init__(self, family: Any, dtype: torch.dtype = torch.float32) -> None:
        self.family, self.dtype = family, dtype
        self._input: dict[str, torch.Tensor] | None = None
        #: microbatch -> outputs of the placeholder calls this rank ran (zero gradient in backward)
        self._fill: dict[int, list[torch.Tensor]] = {}

    def placeholder(self) -> dict[str, torch.Tensor]:
        """The family's placeholder input (:func:`placeholder_input`), preprocessed once."""
        if self._input is None:
            self._input = placeholder_input(self.family, self.dtype)
        return self._input

    def pad(self, inputs: list[dict[str, torch.Tensor]], n: int) -> list[dict[str, torch.Tensor]]:
        """``inputs`` then placeholders up to ``n`` calls (the group's count). The placeholder is
        made only when one is needed: a family without image input (Whisper) has none, and its
        ranks never pad (validation refuses what would make them)."""
        missing = n - len(inputs)
        return list(inputs) + ([self.placeholder()] * missing if missing > 0 else [])

    def keep(self, mb: int, outputs: list[Any]) -> None:
        """The outputs of microbatch ``mb``'s placeholder calls, for its backward (only when
        a backward can come: gradients enabled)."""
        if torch.is_grad_enabled():
            kept = [t for o in outputs for t in grad_tensors(o)]
            if kept:
                self._fill.setdefault(mb, []).extend(kept)

    def zero_seeds(self, mb: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Microbatch ``mb``'s placeholder outputs with a zero gradient each (then forgotten)."""
        return [(o, torch.zeros_like(o)) for o in self._fill.pop(mb, [])]

    def release(self, mb: int) -> None:
        """Forget microbatch ``mb``'s placeholder outputs (no backward will come)."""
        self._fill.pop(mb, None)

    def pending(self) -> int:
        """Microbatches whose placeholder outputs still wait for a backward."""
        return len(self._fill)


def _vote(v: int, device: torch.device) -> int:
    t = torch.tensor([v], dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return int(t)


class RootCalls:
    """Inside the block every call of ``module`` (the root) votes first; :meth:`finish`
    then makes placeholder root calls until no rank has a call of its own left.

    A placeholder call is ``placeholder()``: the family's ``encode`` of an input that makes
    exactly one root call (checked), so that it uses the root's outputs as the real calls do
    (which of them is back-propagated decides an engine's backward fetches)."""

    def __init__(self, module: nn.Module, device: torch.device, placeholder: Callable[[], Any]) -> None:
        self.module, self.device, self.placeholder = module, device, placeholder
        self._filling = False
        self._calls = 0
        self._handle: Any = None
        #: real root calls made inside the block so far
        self.real_calls = 0

    def __enter__(self) -> RootCalls:
        # prepend: the vote must come before an engine's own pre-forward hooks (DeepSpeed's
        # gathers and trace checks), on real and placeholder calls alike
        self._handle = self.module.register_forward_pre_hook(self._pre, prepend=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self._filling:  # the placeholder loop voted for this call already
            self._calls += 1
            return
        _vote(1, self.device)
        self.real_calls += 1

    def finish(self) -> list[torch.Tensor]:
        """Vote 0 until every rank has; one placeholder root call per round in which some
        rank voted 1. Returns the placeholder calls' outputs that need a (zero) gradient."""
        outs: list[torch.Tensor] = []
        while _vote(0, self.device) > 0:
            outs += self._placeholder_call()
        return outs

    def _placeholder_call(self) -> list[torch.Tensor]:
        self._filling, self._calls = True, 0
        try:
            out = self.placeholder()
        finally:
            self._filling = False
        if self._calls != 1:
            raise RuntimeError(
                f"lockstep: the placeholder input made {self._calls} root module calls, not 1; "
                "the group's gathers no longer line up"
            )
        return grad_tensors(out)
