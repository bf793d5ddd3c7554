"""``tools/gpu``: the wheelhouse a bare GPU host needs (``wheelhouse.py``) and the script that
installs it there and runs the check (``run_check.sh``), as docs/gpu.md tells a user to.

The closure and the host's requirement lines are read from this environment (no network). Then
``run_check.sh`` runs with this test's Python as the host: it layers a venv over the host's
site folders, resolves the requirements against what is installed (``--no-index``: nothing
third-party may need fetching, as on the GPU host), installs disagg-core's wheel built from
this checkout, and starts ``python -m disagg.gpucheck`` from the venv's own copy of disagg;
``--device cuda`` on this GPU-less machine then ends in the check's own refusal. Rehearsed in
full (Python 3.12, torch 2.11, transformers 5.17, no Ray, every layout passing) by hand:
docs/gpu.md."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_zero")


def _builder():
    spec = importlib.util.spec_from_file_location("gpu_wheelhouse", ROOT / "tools" / "gpu" / "wheelhouse.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_closure_carries_the_backends_not_torch_or_ray() -> None:
    wh = _builder()
    pins = wh.closure(wh.SKIP, "3.12")
    for needed in (
        "megatron-core",
        "deepspeed",
        "accelerate",
        "pydantic",
        "pydantic-core",
        "transformers",
        "pluggy",
    ):
        assert needed in pins, needed
    for never in ("torch", "ray", "pyarrow", "triton"):
        assert never not in pins, never
    assert not [n for n in pins if n.startswith(("nvidia-", "disagg-"))]
    lines = wh.host_requirements(wh.SKIP, "3.12")
    names = {wh.canon(line.split("<")[0].split(">")[0].split("=")[0].split("[")[0]) for line in lines}
    assert {"megatron-core", "deepspeed", "accelerate", "transformers"} <= names
    assert not names & {"torch", "ray", "pyarrow"} and not [n for n in names if n.startswith("disagg")]
    # the packages' own ranges, so a host's satisfying release is kept
    assert any(line.startswith("megatron-core") and "<0.17" in line for line in lines)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a usable GPU is here: the check would run in full")
def test_run_check_installs_over_the_host_and_reaches_the_check(tmp_path: Path) -> None:
    wh = _builder()
    house = tmp_path / "wheelhouse"
    house.mkdir()
    wh.build_disagg(house, ("disagg-core",))  # the check refuses --device cuda before any plugin loads
    (house / "requirements.txt").write_text("\n".join(wh.host_requirements(wh.SKIP, "3.12")) + "\n")
    out = tmp_path / "report.json"
    env = {
        **os.environ,
        "WHEELHOUSE": str(house),
        "PYTHON": sys.executable,
        "VENV": str(tmp_path / "venv"),
        "PIP_NO_INDEX": "1",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu" / "run_check.sh"), "--device", "cuda", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    # disagg comes from the venv's wheels, torch from the host
    assert f"from {tmp_path / 'venv'}" in log, log
    assert f"torch {torch.__version__}" in log, log
    assert proc.returncode == 1, log
    report = json.loads(out.read_text())
    assert not report["parts"] and "--device cuda" in report["error"]
