"""``nox -s gpu`` fails, never skips, where ``nvidia-smi`` lists a GPU that torch cannot use
(a CPU build of torch, a driver torch cannot talk to): otherwise every test here would be
skipped as "no GPU" and the session would pass having checked nothing."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def _listed_gpus() -> int:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def pytest_sessionstart(session: pytest.Session) -> None:
    listed = _listed_gpus()
    if not listed:
        return
    import torch

    if not torch.cuda.is_available():
        pytest.exit(
            f"nvidia-smi lists {listed} GPU(s) but torch {torch.__version__} (CUDA {torch.version.cuda}) "
            "cannot use them: the GPU suite would check nothing",
            returncode=1,
        )
