"""A rank's ``torch.distributed`` world: one per module group, on the device
the rank was given (CUDA: nccl on Ray's GPU for this actor; else gloo)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_group(
    device_kind: str, master_addr: str, master_port: int, rank: int, world_size: int, timeout: timedelta
) -> torch.device:
    """Join the group's process group; return this rank's device."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device_kind == "cuda" else "cpu")
    if device_kind == "cuda":
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU(s), so index 0 is ours.
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        backend = "nccl"
        # A collective that times out or fails raises in this rank (named as
        # on gloo) after NCCL's communicators are aborted, instead of the
        # watchdog killing the process, which the driver could not tell from
        # a dead node (and recovery would restart into the same failure).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    else:
        device, backend = torch.device("cpu"), "gloo"
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",
    )
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        # NCCL: communicators created now (eagerly, bound to this GPU), so a bad
        # NCCL setup fails set-up naming the rank, not the first step's collective
        **({"device_id": device} if backend == "nccl" else {}),
    )
    return device
