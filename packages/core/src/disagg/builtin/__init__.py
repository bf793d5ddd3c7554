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


@hookimpl
def disagg_register_trackers(register: Callable[[type], None]) -> None:
    # the classes only: each tracker imports its library when a run starts it
    from disagg.metrics.jsonl import JsonlMetricsLogger
    from disagg.trackers.mlflow import MLflowTracker
    from disagg.trackers.tensorboard import TensorBoardTracker
    from disagg.trackers.wandb import WandbTracker

    for cls in (JsonlMetricsLogger, TensorBoardTracker, MLflowTracker, WandbTracker):
        register(cls)
