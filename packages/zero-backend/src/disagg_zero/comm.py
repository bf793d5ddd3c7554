"""DeepSpeed's own collectives, counted as they run.

DeepSpeed calls ``torch.distributed`` itself (through ``deepspeed.comm``), so
``zero`` cannot route its traffic through :class:`disagg.interfaces.CommCounter`
as the other strategies do. Instead, while DeepSpeed works (gathering, backward,
reduction, norm, step), :func:`counted` replaces ``torch.distributed``'s
collectives in this process with wrappers that count each call and the bytes
this rank sends under CommCounter's textbook convention (ring all-reduce
``2(n-1)/n`` of the buffer, all-gather ``(n-1)`` times the input, reduce-scatter
``(n-1)/n`` of the input, broadcast the buffer at the source), then call the
real function. DeepSpeed's backend keeps its own references to the all-gather
and reduce-scatter functions it picked at start-up; those are wrapped too.
A collective that calls another (``_all_gather_base`` -> ``all_gather_into_tensor``)
counts once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from disagg.interfaces import CommCounter
from disagg.kit.cost import rules as ring

_local = threading.local()


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


# sent bytes of one call for a group of n ranks, from the call's bound arguments, by the
# formulas the cost model uses (disagg.kit.cost.rules)
def _all_reduce(a: dict, n: int) -> int:
    return ring.all_reduce(_nbytes(a.get("tensor", a.get("tensors"))), n)


def _all_gather(a: dict, n: int) -> int:
    return ring.all_gather(_nbytes(a.get("input_tensor", a.get("tensor", a.get("input_tensor_list")))), n)


def _reduce_scatter(a: dict, n: int) -> int:
    return ring.reduce_scatter(_nbytes(a.get("output")), n)


def _broadcast(a: dict, n: int) -> int:
    return _nbytes(a.get("tensor")) if a.get("src") == dist.get_rank() else 0


def _reduce(a: dict, n: int) -> int:
    return ring.reduce(_nbytes(a.get("tensor")), n)


Sent = Callable[[dict, int], int]
#: kind -> the torch.distributed functions of that kind, and the bytes one call sends
KINDS: dict[str, tuple[tuple[str, ...], Sent]] = {
    "all_reduce": (("all_reduce", "all_reduce_coalesced"), _all_reduce),
    "all_gather": (
        ("all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_coalesced"),
        _all_gather,
    ),
    "reduce_scatter": (("reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base"), _reduce_scatter),
    "broadcast": (("broadcast",), _broadcast),
    "reduce": (("reduce",), _reduce),
}


def _wrap(fn: Callable, kind: str, sent: Sent, counter: CommCounter) -> Callable:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "depth", 0):  # called by another counted collective
            return fn(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        n = dist.get_world_size(bound.get("group"))
        if n > 1:
            counter.add(kind, sent(bound, n))
        _local.depth = 1
        try:
            return fn(*args, **kwargs)
        finally:
            _local.depth = 0

    wrapper.__disagg_counted__ = True  # type: ignore[attr-defined]
    return wrapper


@contextlib.contextmanager
def counted(counter: CommCounter) -> Iterator[None]:
    """Count every ``torch.distributed`` collective this process makes inside the
    block into ``counter`` (by kind: ``all_reduce``, ``all_gather``,
    ``reduce_scatter``, ``broadcast``, ``reduce``)."""
    saved: list[tuple[Any, str, Any]] = []
    by_fn: dict[int, Callable] = {}
    for kind, (names, sent) in KINDS.items():
        for name in names:
            fn = getattr(c10d, name, None)
            if fn is None or getattr(fn, "__disagg_counted__", False):
                continue
            by_fn[id(fn)] = _wrap(fn, kind, sent, counter)
            for mod in (c10d, dist):
                if getattr(mod, name, None) is fn:
                    saved.append((mod, name, fn))
                    setattr(mod, name, by_fn[id(fn)])
    backend = _deepspeed_backend()
    for attr in ("all_gather_function", "reduce_scatter_function"):
        fn = getattr(backend, attr, None)
        if fn is not None and id(fn) in by_fn:
            saved.append((backend, attr, fn))
            setattr(backend, attr, by_fn[id(fn)])
    try:
        yield
    finally:
        for obj, name, fn in reversed(saved):
            setattr(obj, name, fn)


def _deepspeed_backend() -> Any:
    """DeepSpeed's torch backend object, if DeepSpeed's comm layer is up."""
    import sys

    comm = sys.modules.get("deepspeed.comm.comm")
    return getattr(comm, "cdb", None) if comm is not None else None
