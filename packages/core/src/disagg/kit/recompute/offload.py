"""``parallel.<module>.offload: activations`` (or ``all``): what ``recompute: full`` keeps per block
lives in host memory between the block's forward and its replay.

Under ``full`` a checkpointed block saves only its inputs (torch's non-reentrant checkpoint saves
them through the saved-tensor hooks active around the call, before it installs its own for the
block's inside). Around that call these hooks hand each saved input to torch's own
``torch.autograd.graph.save_on_cpu(pin_memory=True)``: on CUDA a copy into pinned host memory at
the forward (``non_blocking``) and a copy back (``non_blocking``) when the replay reads it, so one
block's input is back on the device at a time, beside that block's replayed saves. On a CPU run
``save_on_cpu`` still copies into a separate host buffer, so the CPU tests run every copy.

What the hooks add to torch's is bookkeeping: parameters are never copied (they are model state,
on the device anyway), and the bytes moved are reported to the activation counter of the forward
(:class:`disagg.kit.recompute.activations.SavedBytes`, its ``host`` callback): the hooks replace
the counter's for these tensors, so its device count no longer holds them, and its host count does.

Torch's hooks copy on the compute stream: the transfers are not overlapped with the block's
compute, and the cost model charges them in full (:mod:`disagg.kit.cost.activation_offload`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from disagg.kit.recompute import activations


class OffloadedInputs(contextlib.AbstractContextManager):
    """Saved-tensor hooks around one checkpointed call: its saved inputs go to host memory through
    ``save_on_cpu``'s pack and come back through its unpack."""

    def __init__(self) -> None:
        # torch's maintained hooks; their pack/unpack are the attributes saved_tensors_hooks keeps
        self._torch = torch.autograd.graph.save_on_cpu(pin_memory=True)
        self._sink = activations.current_sink()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> tuple[bool, Any]:
        sink = self._sink
        if isinstance(t, torch.nn.Parameter) or (sink is not None and sink.is_param(t)):
            return False, t
        if sink is not None:
            sink.offloaded(t.numel() * t.element_size())
        return True, self._torch.pack_hook(t)

    def _unpack(self, packed: tuple[bool, Any]) -> torch.Tensor:
        moved, value = packed
        return self._torch.unpack_hook(value) if moved else value

    def __enter__(self) -> OffloadedInputs:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
