"""Gradient all-reduce overlapped with the step's last backward, as torch DDP's reducer does.

:func:`~disagg.kit.grads.all_reduce_bucketed` sums a replica's gradients after every backward
of the step has finished, so the network idles while backward computes and backward idles while
the network sums. :class:`OverlappedReducer` launches each bucket's all-reduce (asynchronously) as
soon as the step's *last* backward has produced every gradient in it, while backward goes on with
the earlier layers; :meth:`OverlappedReducer.finish` launches what is left, agrees on presence and
waits. The sums are the same: the same tensors summed over the same ranks.

What keeps every rank's collectives in the same order, whatever its share of the samples (a rank
with no image, a parameter only some ranks touch):

* buckets are fixed at set-up over *every* trainable parameter (:func:`bucket_sizes`, the same
  composition the cost model counts), not over the ones that happen to have gradients;
* they are launched strictly in one order (the last bucket first: backward produces the last
  layers' gradients first), a bucket only after all the buckets before it; a rank whose gradients
  never all arrive (an empty rank, an untouched parameter) launches the rest in :meth:`finish`, in
  the same order; a missing gradient is summed as zeros;
* the reducer has its own process group, so its asynchronous calls never interleave with the
  collectives a strategy issues during backward (ulysses' all-to-alls) on the module's group;
* presence (:func:`~disagg.kit.grads.agree_on_grads`'s rule: a parameter no rank got a
  gradient for stays ``None``, so AdamW skips it) is agreed after the buckets, in :meth:`finish`.

A gradient is final only once the step's last backward has accumulated into it: the caller says
which backward that is (:meth:`arm`). A parameter whose gradient arrives twice in that backward
(it cannot with non-reentrant checkpointing, which is what recompute uses) would have been sent
half-summed: that is an error, never a silent partial sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from disagg.interfaces.comm import CommCounter
from disagg.kit.grads.buckets import BUCKET_BYTES, bucket_sizes


class OverlappedReducer:
    """Sums the gradients of ``params`` over ``ranks`` (every rank of the module's group holds the
    whole of each), bucket by bucket while the last backward runs. Build it on every rank alike."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        comm: CommCounter,
        ranks: list[int] | None = None,
        timeout: Any = None,
        cap_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.params = list(params)
        self.comm = comm
        # its own group: async bucket sums must not interleave with backward's own collectives
        kw = {"timeout": timeout} if timeout is not None else {}
        self.group = dist.new_group(ranks=ranks, **kw)
        kinds: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(self.params):
            kinds.setdefault((p.device, p.dtype), []).append(i)
        self.buckets: list[list[int]] = []
        for (_, dtype), idx in kinds.items():
            elem = torch.empty((), dtype=dtype).element_size()
            numels = [self.params[i].numel() for i in idx]
            self.buckets += [[idx[j] for j in b] for b in bucket_sizes(numels, elem, cap_bytes)]
        # launch order: the last bucket first (backward produces the last layers' gradients first)
        self.order = list(range(len(self.buckets)))[::-1]
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)
        ]
        self._reset()

    def _reset(self) -> None:
        self.armed = False
        self._fired = [0] * len(self.params)
        self._waiting = [len(b) for b in self.buckets]
        self._next = 0  # position in self.order of the next bucket to launch
        self._flight: dict[int, tuple[torch.Tensor, Any]] = {}

    def arm(self) -> None:
        """The next backward is this step's last on this rank: launch buckets as they complete."""
        self.armed = True

    def _make_hook(self, i: int) -> Any:
        def hook(p: torch.nn.Parameter) -> None:
            if not self.armed:
                return
            self._fired[i] += 1
            b = self.bucket_of[i]
            if self._fired[i] > 1:
                if b in self._flight:
                    raise RuntimeError(
                        f"parameter {i} got a second gradient in the step's last backward after its "
                        "bucket was sent: the overlapped all-reduce would sum a partial gradient "
                        "(reentrant checkpointing, or a backward called twice for one microbatch?)"
                    )
                return
            self._waiting[b] -= 1
            self._launch_ready()

        return hook

    def _launch_ready(self) -> None:
        while self._next < len(self.order) and self._waiting[self.order[self._next]] == 0:
            self._launch(self.order[self._next])
            self.comm.overlapped_calls += 1  # sent while backward still runs

    def _launch(self, b: int) -> None:
        parts = []
        for i in self.buckets[b]:
            p = self.params[i]
            parts.append((p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1))
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        n = dist.get_world_size(self.group)
        self.comm.add("all_reduce", 2 * (n - 1) * flat.numel() * flat.element_size() // n)
        self._flight[b] = (flat, dist.all_reduce(flat, group=self.group, async_op=True))
        self._next += 1

    def finish(self) -> list[bool]:
        """Launch the buckets not sent yet (in the same order on every rank), agree which
        parameters got a gradient anywhere, wait, and write the sums into ``.grad`` (``None`` for
        a parameter no rank got a gradient for). Returns the presence flags."""
        if not self.params:
            return []
        while self._next < len(self.order):
            self._launch(self.order[self._next])
        here = torch.tensor(
            [p.grad is not None for p in self.params], dtype=torch.int32, device=self.params[0].device
        )
        self.comm.all_reduce(here, group=self.group)
        present = [bool(v) for v in here.tolist()]
        for b, (flat, work) in self._flight.items():
            work.wait()
            offset = 0
            for i in self.buckets[b]:
                p = self.params[i]
                if present[i]:
                    value = flat[offset : offset + p.numel()].view_as(p)
                    if p.grad is None:
                        p.grad = value.clone()
                    else:
                        p.grad.copy_(value)
                offset += p.numel()
        self._reset()
        return present

    def remove(self) -> None:
        """Drop the gradient hooks (the module is being torn down or rebuilt)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
