"""Built-ins, registered through the same hooks as any third-party plugin."""

from __future__ import annotations

from typing import Callable

from disagg import hookimpl


@hookimpl
def disagg_register_strategies(register: Callable[[type], None]) -> None:
    from disagg.builtin.ddp import DDPStrategy

    register(DDPStrategy)


@hookimpl
def disagg_register_schedules(register: Callable[[type], None]) -> None:
    from disagg.builtin.schedules import EncodersAhead, Sequential

    register(Sequential)
    register(EncodersAhead)


@hookimpl
def disagg_register_transports(register: Callable[[type], None]) -> None:
    from disagg.builtin.transports import CudaIpcTransport, DirectTransport, ObjectStoreTransport

    register(ObjectStoreTransport)
    register(CudaIpcTransport)
    for backend in ("gloo", "nccl"):
        register(DirectTransport.for_backend(backend))
