"""``parallel.<module>.offload: optimizer``: a module's optimizer state in host memory.

What lives where, per trainable parameter (as DeepSpeed's ZeRO-Offload, FSDP2's
``CPUOffloadPolicy`` and Megatron's optimizer CPU offload place it):

- **device**: the working weight the forward and backward use (bf16 under ``bf16`` and
  ``bf16-pure``, fp32 under ``fp32``), and each microbatch's gradient until it has been copied out;
- **host** (pinned when the device is CUDA): the master copy the optimizer steps (fp32; under
  ``bf16-pure`` the bf16 copy of the weight), the gradient sums of the step in the master's
  dtype, and AdamW's moments (created by AdamW on the host masters at its first step).

It is :class:`~disagg.kit.masters.MasterWeights` with the masters and gradient sums placed on the
host (:class:`HostMasters`), wrapped by the same :class:`~disagg.kit.masters.MasterOptimizer`:
inside the master view the parameters *are* the host masters, so the group's reduction, the
global norm, clipping, the AdamW step (on the host, :func:`host_adamw`), the checkpoint's state
and a load run on the host copies unchanged, and the working weights are written back (host to
device) when the view is left after a step or a load. Under ``fp32`` the working weight is the
parameter's own device tensor, and the master is a separate host copy of it.

Each microbatch's device gradient is copied out as soon as autograd has accumulated it (the
post-accumulate-grad hook): on CUDA a ``non_blocking`` copy into a pinned staging buffer, so the
copy overlaps the rest of backward; the host adds it into the step's sum when the next copy of the
same parameter needs the buffer, or when the view is entered. On CPU host and device are the same
memory, and the path still runs as written: separate host copies, a copy out per microbatch and a
copy in per step, so the CPU tests exercise every copy the GPU makes.

A strategy that shards with torch FSDP2 (``shard: gradients | parameters``) uses FSDP2's own
``CPUOffloadPolicy`` instead (:func:`fsdp_offload_policy`): its sharded fp32 parameters (the
masters), their gradients and the AdamW state live on the host, and the blocks are gathered to the
device in the compute dtype. ``zero`` uses DeepSpeed's ``offload_optimizer``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn

from disagg.interfaces.precision import Recipe
from disagg.kit.masters import MasterWeights, cast_floating

#: values of ``parallel.<module>.offload``: ``activations`` is recompute's saved block inputs
#: (:mod:`disagg.kit.recompute.offload`), ``all`` both
OffloadMode = Literal["none", "optimizer", "activations", "all"]
OFFLOAD_MODES: tuple[str, ...] = ("none", "optimizer", "activations", "all")


def offloaded(options: Any) -> bool:
    """The optimizer's state offloaded: ``parallel.<module>.offload: optimizer | all``
    (``zero``'s ``offload_optimizer: true`` too)."""
    return getattr(options, "offload", "none") in ("optimizer", "all") or bool(
        getattr(options, "offload_optimizer", False)
    )


def offloads_activations(options: Any) -> bool:
    """``parallel.<module>.offload: activations | all``: the inputs ``recompute: full`` keeps per
    block live in host memory between the block's forward and its replay."""
    return getattr(options, "offload", "none") in ("activations", "all")


def host_device() -> torch.device:
    return torch.device("cpu")


class HostMasters(MasterWeights):
    """Masters and gradient sums of a module's trainable parameters in host memory; the working
    weights on the parameters' device (see the module's docstring)."""

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype, master: torch.dtype) -> None:
        self.master_dtype = master
        devices = {p.device for p in params}
        #: the parameters' device (CUDA: copies are asynchronous and the host buffers pinned)
        self.device = next(iter(devices)) if devices else torch.device("cpu")
        self.pin = self.device.type == "cuda"
        self._staging: dict[int, torch.Tensor] = {}
        self._pending: dict[int, torch.cuda.Event] = {}
        #: a step's gradient-sum buffers kept for the next step (pinned memory is slow to allocate)
        self._spare: dict[int, torch.Tensor] = {}
        super().__init__(params, dtype)

    def _host_empty(self, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(like.shape, dtype=dtype, device=host_device(), pin_memory=self.pin)

    def _master_of(self, p: torch.Tensor) -> torch.Tensor:
        m = self._host_empty(p, self.master_dtype)
        m.copy_(p.detach())  # a separate copy even when host and device are the same memory
        return m

    def _weight_of(self, p: torch.Tensor, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if p.dtype == dtype:
            return p.detach()  # the parameter's own device tensor is the working weight
        return p.detach().to(dtype)

    def _accumulate(self, i: int):  # type: ignore[no-untyped-def]
        def hook(p: torch.Tensor) -> None:
            if self._depth:  # a backward inside the view: the gradient is a host one already
                return
            g = p.grad
            if g is None:
                return
            if self.pin:  # CUDA: copy out asynchronously; the host adds it later
                self._drain(i)
                stage = self._staging.get(i)
                if stage is None or stage.dtype != g.dtype:
                    stage = self._staging[i] = self._host_empty(g, g.dtype)
                stage.copy_(g.detach(), non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._pending[i] = event
            else:
                self._add(i, g.detach())
            p.grad = None  # the device gradient lives only until it is copied out

        return hook

    def _add(self, i: int, g: torch.Tensor) -> None:
        """Add a host (or, on CPU, device = host) gradient into parameter ``i``'s step sum."""
        acc = self.grads[i]
        if acc is None:
            acc = self._spare.pop(i, None)
            if acc is None:
                acc = self._host_empty(g, self.master_dtype)
            acc.copy_(g)
            self.grads[i] = acc
        else:
            acc.add_(g)

    def _drain(self, i: int | None = None) -> None:
        """Wait for the copies out in flight (of parameter ``i``, or all) and add them up."""
        for k in [i] if i is not None else list(self._pending):
            event = self._pending.pop(k, None) if k is not None else None
            if event is not None:
                event.synchronize()
                self._add(k, self._staging[k])  # type: ignore[index]

    @contextlib.contextmanager
    def view(self, write: bool = False) -> Iterator[None]:
        if self._depth == 0:
            self._drain()
        with super().view(write):
            yield

    def _leave(self) -> None:
        held = list(self.grads)
        super()._leave()
        for i, (before, now) in enumerate(zip(held, self.grads)):
            if now is None and before is not None and before.device.type == "cpu":
                self._spare[i] = before  # zero_grad dropped it: reuse the buffer next step

    def _sync(self, which: list[int]) -> None:
        with torch.no_grad():
            for i in which:  # host to device; ordered on the stream before the next forward
                self.weights[i].copy_(self.masters[i], non_blocking=self.pin)
        self._versions = [p._version for p in self.params]

    # -- what a rank holds where ------------------------------------------------------------------
    def host_tensors(self) -> list[torch.Tensor]:
        """The masters and the gradient sums of this step (the optimizer's state is its own)."""
        return list(self.masters) + [g for g in self.grads if g is not None]

    def staging_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._staging.values())


def apply_offload(module: nn.Module, recipe: Recipe | None) -> HostMasters | None:
    """``module`` (parallelized, trainable parameters decided) in ``recipe``'s working weights,
    with the masters of its trainable parameters in host memory (:class:`HostMasters`): the
    recipe's master dtype, or its weights' where it steps them in place (``fp32``, ``bf16-pure``)."""
    weights = recipe.weights if recipe is not None else torch.float32
    master = (recipe.master or recipe.weights) if recipe is not None else torch.float32
    trainable = [p for p in module.parameters() if p.requires_grad and p.is_floating_point()]
    masters = HostMasters(trainable, weights, master) if trainable else None
    if weights != torch.float32:
        cast_floating(module, weights)  # frozen parameters too: no master, working weights only
    return masters


def host_adamw_kernel(device: torch.device) -> dict[str, bool]:
    """The kernel keyword of torch's AdamW for host-resident state (see docs/strategies.md,
    "optimizer offload", for the measurement): on a CUDA run the fused CPU kernel (one pass over
    each tensor, vectorised); on a CPU run the single-tensor one, bit-identical to the reference's
    ``AdamW(foreach=False)``, so an offloaded CPU run equals the same layout without offload."""
    return {"fused": True} if device.type == "cuda" else {"foreach": False}


def fsdp_offload_policy(device: torch.device) -> Any:
    """FSDP2's ``CPUOffloadPolicy`` for ``offload: optimizer`` under ``shard: gradients |
    parameters`` (pinned host memory on CUDA)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def offload_problems(options: Any, where: str) -> list[str]:
    """What ``offload: optimizer | all`` cannot be combined with (config time)."""
    if not offloaded(options) or not hasattr(options, "overlap_grad_reduce"):
        return []
    if getattr(options, "overlap_grad_reduce", False):
        return [
            f"{where}.offload: optimizer cannot be combined with {where}.overlap_grad_reduce: true "
            "(the buckets would sum device gradients that are already copied to the host); "
            "set overlap_grad_reduce: false or offload: none"
        ]
    return []


def resident_bytes(strategy: Any) -> dict[str, int]:
    """What one rank of a kit strategy holds, split by where it lives (``device`` and ``host``):
    parameters and their gradients as the forward sees them, the offloaded masters and gradient
    sums, the optimizer's state. A tensor counts as host-resident when it is on the CPU while the
    module runs on CUDA, or, on a CPU run, when it is one of the offloaded tensors."""
    module = strategy.module
    opt = strategy.optimizer
    masters = getattr(strategy, "master_weights", None)
    host: set[tuple[int, int]] = set()
    state = [
        v for st in (opt.state.values() if opt is not None else []) for v in st.values() if torch.is_tensor(v)
    ]
    if isinstance(masters, HostMasters):
        host = {_key(t) for t in masters.host_tensors() + state}
    elif getattr(strategy, "offload_policy", None):  # FSDP2's CPUOffloadPolicy: shards and state
        host = {_key(_local(p)) for p in module.parameters()}
        host |= {_key(_local(p.grad)) for p in module.parameters() if p.grad is not None}
        host |= {_key(_local(v)) for v in state}
    cuda = strategy.ctx.device.type == "cuda"
    seen: set[tuple[int, int]] = set()
    out = {"device": 0, "host": 0}

    def count(t: torch.Tensor | None) -> None:
        if t is None:
            return
        local = _local(t)
        key = _key(local)
        if key in seen:  # the same memory under another name (a tied weight, a view)
            return
        seen.add(key)
        on_host = key in host or (cuda and local.device.type == "cpu")
        out["host" if on_host else "device"] += local.numel() * local.element_size()

    for p in module.parameters():
        count(p)
        count(p.grad)
    if isinstance(masters, MasterWeights):  # bf16's device masters and sums, or the host ones
        for t in list(masters.masters) + [g for g in masters.grads if g is not None]:
            count(t)
    for v in state:
        count(v)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # type: ignore[no-any-return]


def _key(t: torch.Tensor) -> tuple[int, int]:
    return (t.untyped_storage().data_ptr(), t.storage_offset())
