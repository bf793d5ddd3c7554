"""The device the check runs on, and its one-rank ``torch.distributed`` world."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


class NoDevice(RuntimeError):
    """``--device cuda`` asked for, and torch cannot use a GPU: an error, never a skip."""


def resolve_device(kind: str) -> torch.device:
    """``cuda`` (the first GPU torch can use) or ``cpu``; :class:`NoDevice` when CUDA is asked
    for and torch has none (a CPU build of torch, a driver it cannot talk to, no GPU)."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ValueError(f"--device: {kind!r}; allowed: cuda, cpu")
    if not torch.cuda.is_available():
        why = "torch has no CUDA build" if torch.version.cuda is None else "torch sees no usable GPU"
        raise NoDevice(
            f"--device cuda: {why} (torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
            "run with --device cpu for the tiny CPU check"
        )
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device


def init_world(device: torch.device) -> None:
    """A ``torch.distributed`` world of one rank on ``device`` (nccl on CUDA, gloo on CPU), set up
    as core's worker sets up a rank (``disagg.runtime.actor.process_group``), so DeepSpeed and
    megatron-core see the environment they expect."""
    from disagg.runtime.actor.process_group import init_group
    from disagg.testing.dist import free_port

    if dist.is_initialized():
        return
    init_group(device.type, "127.0.0.1", free_port(), 0, 1, timedelta(minutes=10))


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_flops(device: torch.device) -> float:
    """Dense bf16 peak FLOP/s for MFU: ``DISAGG_PEAK_TFLOPS`` if set, else H100/H200 SXM's 989
    TFLOP/s on CUDA; on CPU the MFU is not meaningful and reported against 1 TFLOP/s."""
    env = os.environ.get("DISAGG_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    return 989e12 if device.type == "cuda" else 1e12
