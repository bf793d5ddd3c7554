"""One device's peak dense FLOP/s in a run's precision: what ``mfu`` divides by.

CUDA: the GPU model as Ray labels it (``accelerator_type:<model>`` in the cluster's
resources) and NVIDIA's datasheet figure for the precision's compute dtype (bf16 tensor
cores under ``bf16``/``bf16-pure``; plain fp32 under ``fp32``, as PyTorch's default
``float32_matmul_precision = "highest"`` keeps TF32 off). CPU: the ``cpu`` planning
preset's per-device rate (:data:`disagg.plan.cluster.PRESETS`, one rank per core; an order
of magnitude, not a measurement: ``disagg plan --calibrate`` measures this machine's).
"""

from __future__ import annotations

from typing import Any

#: dense peak FLOP/s per GPU (datasheets; no structured sparsity): bf16 tensor cores, fp32 (CUDA cores).
#: Ray labels H100 SXM and PCIe alike: the SXM figures are taken.
GPU_PEAKS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "L4": {"bf16": 121e12, "fp32": 30.3e12},
}


def device_peak(device: str, precision: str, cluster_resources: dict[str, Any]) -> tuple[float | None, str]:
    """``(peak FLOP/s of one device, where the figure comes from)``; ``None`` for a GPU model
    not in :data:`GPU_PEAKS` (``mfu`` is then left out)."""
    dtype = "fp32" if precision == "fp32" else "bf16"
    if device == "cpu":
        from disagg.plan.cluster import PRESETS

        peak = PRESETS["cpu"].peak_flops
        return peak, f"cpu: {peak / 1e9:.3g} GFLOP/s per rank (the 'cpu' planning preset, fp32)"
    models = sorted(k.split(":", 1)[1] for k in cluster_resources if k.startswith("accelerator_type:"))
    for model in models:
        base = model.split("-")[0]  # "A100-80G" -> "A100"
        if base in GPU_PEAKS:
            peak = GPU_PEAKS[base][dtype]
            return peak, f"{model}: {peak / 1e12:.4g} TFLOP/s {dtype} (datasheet, dense)"
    return None, f"no peak known for GPU {', '.join(models) or '(model unknown)'}: mfu left out"


__all__ = ["GPU_PEAKS", "device_peak"]
