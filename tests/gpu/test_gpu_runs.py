"""The CUDA path through Ray (``nox -s gpu``; skipped as "no GPU: skipped" elsewhere).

Each strategy at degree 1 trains the tiny Qwen2.5-VL on CUDA in bf16, both
groups collocated on one GPU with fractional GPUs, and matches the CPU fp32
run (itself equal to the single-process HF model, ``test_e2e_hybrid``) within
the project's bf16 tolerance (:data:`disagg.testing.tolerance.BF16`: losses
within 8 bf16 epsilons = 3.1 %, weights within the bf16 lr-unit bound); the
object-store and CUDA IPC transports both carry it; a checkpoint saved on
CUDA resumes to the uninterrupted run's weights; the CUDA metrics are filled.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_zero")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e_run import e2e_config, train  # noqa: E402

from disagg.config.validate import validate
from disagg.plugins import get_registry  # noqa: E402
from disagg.runtime.plan import make_plan  # noqa: E402
from disagg.testing.tolerance import BF16, assert_params_close, assert_scalar_close  # noqa: E402

pytestmark = pytest.mark.gpu

FAMILY = "qwen2_5_vl"
STEPS = 2
LR = 1e-3
DDP = {"strategy": "ddp"}
#: vision, llm, transport: every strategy once at degree 1, both transports
CASES = {
    "ddp+ddp/object_store": (DDP, DDP, "object_store"),
    "ulysses+megatron_tp/cuda_ipc": ({"strategy": "ulysses"}, {"strategy": "megatron_tp"}, "cuda_ipc"),
    "zero2+zero3/auto": ({"strategy": "zero", "stage": 2}, {"strategy": "zero", "stage": 3}, "auto"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from disagg.cli.make_tiny import make_tiny

    return make_tiny(
        tmp_path_factory.mktemp("tiny"), [FAMILY], train_per_class=1, eval_per_class=1, image_size=56
    )


def _cfg(tiny, out: Path, vision: dict, llm: dict, device: str, transport: str = "auto", **extra):
    families = {"vision": (FAMILY, FAMILY), "llm": (FAMILY, FAMILY)}
    parallel = {"vision": vision, "llm": llm, "placement": "collocated", "transport": transport}
    cfg = e2e_config(tiny, out, families, parallel, STEPS)
    raw = cfg.model_dump(mode="json")
    raw["train"].update(device=device, precision="fp32" if device == "cpu" else "bf16")
    for key, value in extra.items():
        section, name = key.split("__")
        raw[section][name] = value
    return type(cfg).model_validate(raw)


@pytest.fixture(scope="module")
def cpu_fp32(ray_local, tiny, tmp_path_factory):
    return train(_cfg(tiny, tmp_path_factory.mktemp("cpu"), DDP, DDP, "cpu"))


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.parametrize("name", list(CASES))
def test_strategy_on_cuda_bf16_matches_cpu_fp32(ray_local, tiny, cpu_fp32, tmp_path, name):
    vision, llm, transport = CASES[name]
    cfg = _cfg(tiny, tmp_path / "run", vision, llm, "cuda", transport)
    plan = make_plan(
        validate(cfg, get_registry()), get_registry(), ray_local.cluster_resources().get("GPU", 0.0)
    )
    assert plan.transport.name == ("cuda_ipc" if transport == "auto" else transport)  # one shared GPU
    losses, weights = train(cfg)
    want_losses, want_weights = cpu_fp32
    for step, (got, want) in enumerate(zip(losses, want_losses), 1):
        assert_scalar_close(got, want, f"{name} step {step} loss", BF16)
    for m in ("vision", "llm"):
        assert_params_close(
            weights[m], want_weights[m], lr=LR, steps=STEPS, grads=None, what=f"{name} {m}: ", precision=BF16
        )
    for rec in _metrics(tmp_path / "run"):
        (gpu,) = rec["gpu_mem_bytes"].values()  # both groups on one GPU
        assert gpu["peak_reserved_bytes"] >= sum(rec["peak_mem_bytes"].values()) > 0
        assert gpu["used_bytes"] >= gpu["peak_reserved_bytes"] // 2
        for m in ("vision", "llm"):
            assert rec["device_s"][m] > 0 and rec["peak_reserved_bytes"][m] >= rec["peak_mem_bytes"][m]


def test_fractional_shares_of_one_gpu(ray_local, tiny, cpu_fp32, tmp_path):
    """Explicit fractions (0.3 + 0.7 of the GPU) place both groups on it."""
    vision = {**DDP, "resources": {"num_gpus": 0.3}}
    llm = {**DDP, "resources": {"num_gpus": 0.7}}
    losses, _ = train(_cfg(tiny, tmp_path / "run", vision, llm, "cuda"))
    for step, (got, want) in enumerate(zip(losses, cpu_fp32[0]), 1):
        assert_scalar_close(got, want, f"fractional step {step} loss", BF16)
    assert all(len(r["gpu_mem_bytes"]) == 1 for r in _metrics(tmp_path / "run"))


def test_checkpoint_round_trip_on_cuda(ray_local, tiny, tmp_path):
    """Saved on CUDA after step 1, resumed by new groups: step 2 and the final
    weights equal the uninterrupted run's (bf16 tolerance: CUDA kernels may
    reduce in another order from run to run)."""
    llm = {"strategy": "megatron_tp"}
    full = _cfg(tiny, tmp_path / "full", DDP, llm, "cuda", checkpoint__every=1)
    losses, weights = train(full)
    ckpt = tmp_path / "full" / "checkpoints" / "step-1"
    assert (ckpt / "manifest.json").is_file()
    resumed = _cfg(tiny, tmp_path / "resumed", DDP, llm, "cuda", checkpoint__resume_from=str(ckpt))
    got_losses, got_weights = train(resumed)
    assert_scalar_close(got_losses[-1], losses[-1], "step 2 loss after resume", BF16)
    for m in ("vision", "llm"):
        assert_params_close(
            got_weights[m], weights[m], lr=LR, steps=1, grads=None, what=f"resumed {m}: ", precision=BF16
        )
