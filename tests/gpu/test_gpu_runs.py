"""The CUDA path through Ray (``nox -s gpu``; skipped as "no GPU: skipped" elsewhere).

Each strategy at degree 1 trains the tiny Qwen2.5-VL on CUDA in bf16, both
groups collocated on one GPU with fractional GPUs, and matches the single-process
HF model trained in float32 on the same batches: losses within 8 bf16 epsilons
(:data:`disagg.testing.tolerance.BF16`), weights per element in lr units from the
reference's own first gradients at the recipe's bound (bf16 compute, fp32 masters:
:data:`~disagg.testing.tolerance.BF16_COMPUTE`), so a skipped or doubled update
fails; the object-store and CUDA IPC transports both carry it; a checkpoint saved
on CUDA resumes to the uninterrupted run's weights under the same per-element
bound (a resume that lost its checkpoint fails); the CUDA metrics are filled.
The checks are ``tests/weight_checks.py``'s, run on CPU in bf16 and shown to fail
on injected faults by ``tests/test_weight_checks_cpu.py``.
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
import weight_checks as W  # noqa: E402
from e2e_run import train  # noqa: E402

from disagg.config.validate import validate
from disagg.plugins import get_registry  # noqa: E402
from disagg.runtime.plan import make_plan  # noqa: E402
from disagg.testing.tolerance import BF16, BF16_COMPUTE, assert_scalar_close  # noqa: E402

pytestmark = pytest.mark.gpu

FAMILY = "qwen2_5_vl"
STEPS = 2
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
    precision = "fp32" if device == "cpu" else "bf16"
    return W.run_config(tiny, out, vision, llm, device, precision, STEPS, transport, **extra)


@pytest.fixture(scope="module")
def reference(ray_local, tiny, tmp_path_factory) -> W.Reference:
    """The HF model in float32 on the CPU, on the runs' batches: losses, states, gradients."""
    return W.hf_reference(_cfg(tiny, tmp_path_factory.mktemp("ref"), DDP, DDP, "cpu"), STEPS)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.parametrize("name", list(CASES))
def test_strategy_on_cuda_bf16_matches_the_hf_model(ray_local, tiny, reference, tmp_path, name):
    vision, llm, transport = CASES[name]
    cfg = _cfg(tiny, tmp_path / "run", vision, llm, "cuda", transport)
    plan = make_plan(
        validate(cfg, get_registry()), get_registry(), ray_local.cluster_resources().get("GPU", 0.0)
    )
    assert plan.transport.name == ("cuda_ipc" if transport == "auto" else transport)  # one shared GPU
    losses, weights = train(cfg)
    W.assert_losses_match(losses, reference, BF16, f"{name} ")
    W.assert_weights_match(weights, reference, STEPS, cfg.train, BF16_COMPUTE, f"{name} ")
    for rec in _metrics(tmp_path / "run"):
        (gpu,) = rec["gpu_mem_bytes"].values()  # both groups on one GPU
        assert gpu["peak_reserved_bytes"] >= sum(rec["peak_mem_bytes"].values()) > 0
        assert gpu["used_bytes"] >= gpu["peak_reserved_bytes"] // 2
        for m in ("vision", "llm"):
            assert rec["device_s"][m] > 0 and rec["peak_reserved_bytes"][m] >= rec["peak_mem_bytes"][m]


def test_fractional_shares_of_one_gpu(ray_local, tiny, reference, tmp_path):
    """Explicit fractions (0.3 + 0.7 of the GPU) place both groups on it."""
    vision = {**DDP, "resources": {"num_gpus": 0.3}}
    llm = {**DDP, "resources": {"num_gpus": 0.7}}
    cfg = _cfg(tiny, tmp_path / "run", vision, llm, "cuda")
    losses, weights = train(cfg)
    W.assert_losses_match(losses, reference, BF16, "fractional ")
    W.assert_weights_match(weights, reference, STEPS, cfg.train, BF16_COMPUTE, "fractional ")
    assert all(len(r["gpu_mem_bytes"]) == 1 for r in _metrics(tmp_path / "run"))


def test_checkpoint_round_trip_on_cuda(ray_local, tiny, reference, tmp_path):
    """Saved on CUDA after step 1, resumed by new groups: step 2 and the final
    weights equal the uninterrupted run's (bf16 tolerance: CUDA kernels may
    reduce in another order from run to run), each element within the bound the
    reference's gradients give it, which a resume missing an update exceeds."""
    llm = {"strategy": "megatron_tp"}
    full = _cfg(tiny, tmp_path / "full", DDP, llm, "cuda", checkpoint__every=1)
    losses, weights = train(full)
    ckpt = tmp_path / "full" / "checkpoints" / "step-1"
    assert (ckpt / "manifest.json").is_file()
    resumed = _cfg(tiny, tmp_path / "resumed", DDP, llm, "cuda", checkpoint__resume_from=str(ckpt))
    got_losses, got_weights = train(resumed)
    assert_scalar_close(got_losses[-1], losses[-1], "step 2 loss after resume", BF16)
    W.assert_resume_matches(got_weights, weights, reference, STEPS, full.train, BF16_COMPUTE, "resumed ")
    W.assert_weights_match(weights, reference, STEPS, full.train, BF16_COMPUTE, "uninterrupted ")
