"""Schedules: the order in which one step's microbatches pass through the groups.

A Ray actor runs its calls one at a time, in the order they were submitted.
So the schedule of a step is simply the order in which the driver submits
each microbatch's three phases:

* ``forward`` k: every encoder group encodes microbatch k and hands its shards on;
* ``llm`` k: the language model runs forward + backward on microbatch k;
* ``backward`` k: the encoders run backward from the gradients of microbatch k.

Within one microbatch the phases come in that order; across microbatches a
schedule may interleave them (``encoders_ahead`` encodes k+1.. while the
language model still works on k). The driver checks every order it is given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

Phase = Literal["forward", "llm", "backward"]


@dataclass(frozen=True)
class Op:
    phase: Phase
    #: microbatch index within the step, 0..microbatches-1
    mb: int


class Schedule(ABC):
    """Registered through ``disagg_register_schedules``; chosen by ``train.schedule``."""

    #: value of ``train.schedule``
    name: ClassVar[str]

    @abstractmethod
    def order(self, microbatches: int, *, max_inflight: int, frozen: bool) -> list[Op]:
        """Every ``forward``, ``llm`` and ``backward`` op of one step, once each.

        ``max_inflight``: most microbatches an encoder may hold activations
        for (encoded, not yet backwarded). ``frozen``: no encoder trains, so
        no ``backward`` op is needed and encoders keep no activations.
        """


def check_order(ops: list[Op], microbatches: int, *, max_inflight: int, frozen: bool, name: str) -> None:
    """Raise ``ValueError`` naming the schedule when ``ops`` is not a valid step."""
    phases: tuple[Phase, ...] = ("forward", "llm") if frozen else ("forward", "llm", "backward")
    want = sorted((p, k) for p in phases for k in range(microbatches))
    got = sorted((op.phase, op.mb) for op in ops)
    if got != want:
        raise ValueError(f"schedule {name!r} must give each of {', '.join(phases)} once per microbatch")
    done: set[tuple[str, int]] = set()
    inflight = 0
    for op in ops:
        before = {"forward": None, "llm": "forward", "backward": "llm"}[op.phase]
        if before is not None and (before, op.mb) not in done:
            raise ValueError(f"schedule {name!r} runs {op.phase} {op.mb} before {before} {op.mb}")
        done.add((op.phase, op.mb))
        if not frozen:
            inflight += {"forward": 1, "backward": -1}.get(op.phase, 0)
            if inflight > max_inflight:
                raise ValueError(
                    f"schedule {name!r} holds {inflight} microbatches in an encoder, "
                    f"more than train.max_inflight={max_inflight}"
                )
