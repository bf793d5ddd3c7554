"""A rank's accounting of one step: host time busy and waiting on other
groups, GPU time, saved-activation bytes, bytes sent, and the figures read at
the step's end (memory, collectives, state bytes, lr), gathered in one
:class:`~disagg.metrics.record.RankRecord` that the worker hands back with the
step and then starts afresh."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from disagg.kit.recompute.activations import saved_bytes_hooks
from disagg.metrics.record import RankRecord
from disagg.runtime.actor.device_stats import DeviceTimer, record_memory

#: calls whose GPU time counts as ``device_s`` (``step`` times its own optimizer work)
DEVICE_TIMED = frozenset(
    {"encode", "shards_for", "backward", "loss_and_backward", "grads_for", "reduce_and_norm"}
)
#: an encoder's own work on samples (its ``encode_s``); what a feature cache hit saves
ENCODER_CALLS = frozenset({"encode", "shards_for", "cache_out"})
#: calls whose arguments are another group's outputs (their wait counts as ``wait_s``)
CONSUMERS = frozenset({"loss_and_backward", "backward"})
#: calls between steps (set-up, checkpoints): their time belongs to no step; counted, set-up
#: (loading the weights) made step 1's ``busy_s`` exceed its ``step_time_s`` twentyfold
OUTSIDE_STEPS = frozenset({"setup", "save_full", "load_full", "full_state_dict", "full_grads"})


class Accounting:
    """The figures of the step in progress on one rank."""

    def __init__(self, module: str, rank: int, cuda: bool) -> None:
        self.module, self.rank = module, rank
        self.record = RankRecord(module, rank)
        #: saved-activation bytes per microbatch in flight; their sum peaks at record.activation_bytes
        self.live_bytes: dict[int, int] = {}
        #: end of the last call (None: none in this step yet), for wait_s
        self.idle_from: float | None = None
        #: GPU time of this step's calls (CUDA events), for device_s
        self.timer = DeviceTimer(cuda)

    @contextlib.contextmanager
    def call(self, name: str) -> Iterator[None]:
        """Time one actor call: ``busy_s`` is the time inside it minus what it
        spent blocked on another group, ``wait_s`` the idle time before a call
        that consumes another group's outputs."""
        if name in OUTSIDE_STEPS:
            try:
                yield
            finally:
                self.idle_from = time.perf_counter()  # the next step's wait starts here, not before
            return
        rec = self.record  # step() starts a new record; this call's time belongs to the old one
        t0, waited = time.perf_counter(), rec.wait_s
        start = self.timer.start() if name in DEVICE_TIMED else None  # CUDA: no sync
        if name in CONSUMERS and self.idle_from is not None:
            # Ray started this call once its shard/gradient arguments had arrived:
            # the rank idled since its last call waiting on another group
            rec.wait_s += t0 - self.idle_from
            waited = rec.wait_s
        try:
            yield
        finally:
            busy = time.perf_counter() - t0 - (rec.wait_s - waited)
            rec.busy_s += busy
            if name in ENCODER_CALLS:
                rec.encode_s += busy
            self.idle_from = time.perf_counter()
            self.timer.stop(start)

    def sent(self, t: torch.Tensor) -> None:
        """``t`` leaves for another group."""
        self.record.sent_bytes += t.numel() * t.element_size()

    def count_saved(self, module: nn.Module, mb: int) -> Any:
        """Count bytes autograd saves for backward (machine-independent
        activation memory), live per microbatch until its backward."""
        self.live_bytes.setdefault(mb, 0)

        def add(nbytes: int) -> None:
            self.live_bytes[mb] = self.live_bytes.get(mb, 0) + nbytes
            self.record.activation_bytes = max(self.record.activation_bytes, sum(self.live_bytes.values()))

        def peak(nbytes: int) -> None:
            # one recomputed block's saves, held on top of everything live until its backward
            self.record.activation_bytes = max(
                self.record.activation_bytes, sum(self.live_bytes.values()) + nbytes
            )

        return saved_bytes_hooks(module, add, peak)

    def freed(self, mb: int) -> None:
        """Microbatch ``mb``'s saved activations are gone (backward ran, or dropped)."""
        self.live_bytes.pop(mb, None)

    def finish_step(self, strategy: Any, lr: float, step_time: Any) -> RankRecord:
        """The step's record (``step_time``: a timer start of the optimizer step
        itself), and a fresh one for the next step."""
        ctx = strategy.ctx
        rec = self.record
        self.timer.stop(step_time)
        rec.device_s = self.timer.read()  # the step's one sync, on CUDA
        record_memory(rec, ctx.device)
        rec.collective_calls = ctx.comm.calls()
        rec.overlapped_calls = ctx.comm.overlapped_calls
        rec.collective_bytes = ctx.comm.reset()
        rec.state_bytes = strategy.state_bytes()
        rec.lr = lr
        self.record = RankRecord(self.module, self.rank)
        return rec

    def finish_evaluation(self, comm: Any) -> RankRecord:
        """An evaluation's record (its time and collectives) and a fresh one, so
        that evaluation between steps counts toward no training step."""
        rec = self.record
        rec.collective_calls = comm.calls()
        rec.collective_bytes = comm.reset()
        self.record = RankRecord(self.module, self.rank)
        self.live_bytes.clear()
        return rec
