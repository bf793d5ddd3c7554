"""The same submodule calls on every rank of a ZeRO-3 group, whatever its samples.

DeepSpeed's ZeRO-3 gathers each submodule's parameters in hooks around its forward and
backward (all-gathers), records the sequence of submodule calls to prefetch from, and checks
the recorded sequence across ranks (collectives) at each root forward. So every rank of the
group must call the same submodules in the same order. What the family's code calls follows
the data: an encoder's root module once per sample or per item, the LLM's embedding per sample
(some families), its output head once per loss chunk, and a rank without samples calls nothing.
This module makes the calls agree, as core's FSDP2 path does (``disagg.kit.sharding``:
short ranks run placeholder forwards whose output gradient is zero, so they add exact zeros):

* **encoder** (:class:`RootCalls`): before each call of the root module every rank votes in
  one one-element all-reduce; a rank that has made all its own calls keeps voting 0 and makes a
  placeholder root call while some rank still votes 1. Every root call of every rank is then
  preceded by the same vote, so all ranks make the same number of root calls, each running the
  module's fixed sequence of submodules;
* **LLM** (:func:`placeholder_sample`, :func:`padded_spans`): every rank forwards as many
  samples as the busiest (text placeholders of one token with no label: they add no loss and a
  gradient of exact zeros) and as many loss chunks (empty ones past its tokens).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def agreed_max(n: int, device: torch.device) -> int:
    """The largest ``n`` over the group (one small all-reduce; counted by the caller's
    :func:`disagg_zero.comm.counted` block)."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def _vote(v: int, device: torch.device) -> int:
    t = torch.tensor([v], dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return int(t)


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


class RootCalls:
    """Inside the block every call of ``module`` (the root) votes first; :meth:`finish`
    then makes placeholder root calls until no rank has a call of its own left.

    A placeholder call is ``placeholder()``: the family's ``encode`` of an input that makes
    exactly one root call (checked), so that it uses the root's outputs as the real calls do
    (which of them is back-propagated decides DeepSpeed's backward fetches)."""

    def __init__(self, module: nn.Module, device: torch.device, placeholder: Callable[[], Any]) -> None:
        self.module, self.device, self.placeholder = module, device, placeholder
        self._filling = False
        self._calls = 0
        self._handle: Any = None
        #: real root calls made inside the block so far
        self.real_calls = 0

    def __enter__(self) -> RootCalls:
        # prepend: the vote must come before DeepSpeed's own pre-forward hooks (its gathers
        # and its trace checks), on real and placeholder calls alike
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
                f"ZeRO-3 per-layer gathering: the placeholder input made {self._calls} root module "
                "calls, not 1; the group's gathers no longer line up"
            )
        return grad_tensors(out)


@contextlib.contextmanager
def without_dropout(module: nn.Module) -> Iterator[None]:
    """A placeholder's forward inside draws no dropout mask: every submodule in eval mode but
    Hugging Face's gradient-checkpointing layers, whose train mode decides whether they are
    recomputed (the group's gathers follow that). Its gradient is zero whatever the masks; a
    rank without samples draws nothing, as under ``ddp``, and its random stream stays put."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    flipped = [m for m in module.modules() if m.training and not isinstance(m, GradientCheckpointingLayer)]
    for m in flipped:
        m.training = False
    try:
        yield
    finally:
        for m in flipped:
            m.training = True


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


def padded_spans(tokens: int, chunk: int | None, device: torch.device) -> list[tuple[int, int]]:
    """This rank's loss chunks ``[start, end)`` over ``tokens`` rows, padded with empty ones
    to the group's most (one small all-reduce)."""
    from disagg.kit.chunked_loss import bounds

    spans = bounds(tokens, chunk)
    k = agreed_max(len(spans), device)
    return spans + [(tokens, tokens)] * (k - len(spans))
