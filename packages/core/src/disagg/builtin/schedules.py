"""The built-in schedules: ``sequential`` and ``encoders_ahead``."""

from __future__ import annotations

from typing import ClassVar

from disagg.interfaces.schedule import Op, Schedule


class Sequential(Schedule):
    """Each microbatch goes encoder forward -> LLM -> encoder backward before
    the next starts: the least activation memory, no overlap between groups."""

    name: ClassVar[str] = "sequential"

    def order(self, microbatches: int, *, max_inflight: int, frozen: bool) -> list[Op]:
        ops = []
        for k in range(microbatches):
            ops += [Op("forward", k), Op("llm", k)]
            if not frozen:
                ops.append(Op("backward", k))
        return ops


class EncodersAhead(Schedule):
    """Encoders run forward up to ``max_inflight`` microbatches ahead of their
    backward, so the language model finds microbatch k+1's embeddings ready
    when it finishes k. Encoder backward k is queued right after the LLM's k,
    so it runs as soon as those gradients exist. A frozen encoder keeps no
    activations and runs every forward first."""

    name: ClassVar[str] = "encoders_ahead"

    def order(self, microbatches: int, *, max_inflight: int, frozen: bool) -> list[Op]:
        if frozen:
            return [Op("forward", k) for k in range(microbatches)] + [
                Op("llm", k) for k in range(microbatches)
            ]
        ahead = max(1, min(max_inflight, microbatches))
        ops = [Op("forward", k) for k in range(ahead)]
        for k in range(microbatches):
            ops += [Op("llm", k), Op("backward", k)]
            if k + ahead < microbatches:
                ops.append(Op("forward", k + ahead))
        return ops
