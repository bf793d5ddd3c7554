"""Part 1: every strategy at one rank against the Hugging Face model, and the two injected
faults the comparison must catch.

Each layout runs ``recompute: full`` in the run's recipe (``bf16`` on CUDA: bf16 weights and
activations, float32 masters, gradients and moments; no autocast) for :data:`STEPS` steps
on captioned images of several sizes plus a text-only sample, and is compared with the HF
model trained on the same device and recipe (:mod:`.compare`). A layout whose strategy's
plugin is not installed fails, unless ``--exclude`` names it.

The self-tests run the first layout that ran again with a fault injected (an optimizer step
skipped; the images replaced by noise) and pass only when the comparison fails. The test hook
``DISAGG_GPUCHECK_UNCAUGHT=<fault>`` leaves that fault out (the run is honest, so nothing can
catch it): the check must then fail, which proves the verdict depends on the self-tests.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from disagg.gpucheck import inputs
from disagg.gpucheck.compare import compare, precisions
from disagg.gpucheck.layout_memory import allocator_peak, memory_record, predicted_bytes
from disagg.gpucheck.reference import train_hf
from disagg.gpucheck.run_strategies import FAULTS, Layout, run_layout
from disagg.interfaces import OptimSpec

STEPS = 2
#: weight decay on (design: test as real runs train); eps 1e-3 keeps Adam's update Lipschitz
#: in the gradient, so every element with a resolved gradient is held to a fraction of lr
OPTIM = OptimSpec(lr=1e-3, weight_decay=0.1, eps=1e-3)
#: the hook that leaves one fault uncaught (tests of the check's own verdict)
UNCAUGHT_ENV = "DISAGG_GPUCHECK_UNCAUGHT"

LAYOUTS: tuple[Layout, ...] = (
    Layout("ddp", ("ddp", {}), ("ddp", {})),
    Layout("ulysses", ("ulysses", {}), ("ddp", {})),
    Layout("megatron_tp", ("megatron_tp", {}), ("megatron_tp", {})),
    # the published DHP layout's strategies: ulysses tower, TP LLM with sequence parallelism
    Layout("megatron_tp+sp", ("ulysses", {}), ("megatron_tp", {"sequence_parallel": True})),
    Layout("zero1", ("zero", {"stage": 1}), ("zero", {"stage": 1})),
    Layout("zero3", ("zero", {"stage": 3}), ("zero", {"stage": 3})),
    Layout("shard_parameters", ("ddp", {"shard": "parameters"}), ("ddp", {"shard": "parameters"})),
)


def layout_strategies(layout: Layout) -> set[str]:
    return {layout.vision[0], layout.llm[0]}


def selected(exclude: set[str]) -> tuple[list[Layout], list[dict[str, str]]]:
    """Layouts to run, and those excluded by name or by strategy (reported, never silent)."""
    run, skipped = [], []
    for lay in LAYOUTS:
        hit = ({lay.name} | layout_strategies(lay)) & exclude
        if hit:
            skipped.append({"layout": lay.name, "excluded_by": ",".join(sorted(hit))})
        else:
            run.append(lay)
    return run, skipped


def model_flops(model_dir: Path, samples: list[dict], device: torch.device, dtype: torch.dtype) -> float:
    """FLOPs of one training step of the model (forward + backward, no recompute), counted by
    torch's FLOP counter on the HF model: the numerator of MFU, independent of the strategy."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen2_5_VLForConditionalGeneration

    from disagg.gpucheck.reference import hf_kwargs

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(device)
    counter = FlopCounterMode(display=False)
    with counter:
        for s in samples:
            model(**hf_kwargs(s, model.config.image_token_id, device)).loss.backward()
    return float(counter.get_total_flops())


def run(
    device: torch.device, precision: str, registry: Any, exclude: set[str], work: Path | None = None
) -> dict:
    """The part's report: per layout the margins, failures, step times and MFU; the faults."""
    from disagg.gpucheck.device import peak_flops

    tmp = tempfile.TemporaryDirectory() if work is None else None
    root = Path(tmp.name) if tmp is not None else work
    try:
        model_dir = inputs.make_model_dir(root / "tiny")
        families = inputs.families_from_registry(model_dir, registry)
        images = inputs.CUDA_IMAGES if device.type == "cuda" else inputs.CPU_IMAGES
        batch = inputs.make_batch(model_dir, families, root, images)
        t0 = time.perf_counter()
        ref = train_hf(model_dir, batch.samples, STEPS, OPTIM, precision, device)
        # the float32 reference bounds what a bf16 reference can be asked for (compare.precisions)
        ref32 = (
            None if precision == "fp32" else train_hf(model_dir, batch.samples, STEPS, OPTIM, "fp32", device)
        )
        precs = precisions(precision, ref, ref32)
        flops = model_flops(model_dir, batch.samples, device, ref_dtype(precision))
        out: dict[str, Any] = {
            "precision": precision,
            "recompute": "full",
            "steps": STEPS,
            "optim": {"lr": OPTIM.lr, "weight_decay": OPTIM.weight_decay, "eps": OPTIM.eps},
            "samples": [
                {
                    "tokens": int(s["llm"]["input_ids"].numel()),
                    "images": [list(map(int, g)) for g in s["vision"]["image_grid_thw"].tolist()]
                    if "vision" in s
                    else [],
                }
                for s in batch.samples
            ],
            "reference": {"losses": ref.losses, "step_s": ref.seconds, "seconds": time.perf_counter() - t0},
            "model_flops_per_step": flops,
            "layouts": {},
        }
        layouts, skipped = selected(exclude)
        out["excluded"] = skipped
        first = None
        for lay in layouts:
            rec: dict[str, Any] = {"vision": _describe(lay.vision), "llm": _describe(lay.llm)}
            try:
                with allocator_peak(device) as peak:
                    got = run_layout(lay, registry, families, batch.samples, STEPS, OPTIM, precision, device)
            except Exception as exc:  # a missing plugin or a crash is this layout's failure
                # the traceback too: a remote GPU run is read from its report alone
                rec.update(
                    ok=False, failures=[f"{type(exc).__name__}: {exc}"], traceback=traceback.format_exc()
                )
                out["layouts"][lay.name] = rec
                continue
            rec.update(compare(got, ref, precision, OPTIM, precs))
            rec["memory"] = _memory(lay, model_dir, batch.samples, precision, peak)
            if device.type == "cuda" and not (rec["memory"].get("measured_bytes") or 0) > 0:
                rec["failures"].append("memory: no allocator peak was read")  # never a silent pass
                rec["ok"] = False
            step_s = got.seconds[-1]  # the second step: kernels chosen, memory reserved
            rec.update(
                losses=got.losses,
                step_s=got.seconds,
                mfu=flops / step_s / peak_flops(device),
            )
            out["layouts"][lay.name] = rec
            if rec["ok"] and first is None:  # faults go into a layout that passed honestly
                first = lay
        out["faults"] = self_tests(first, registry, families, batch.samples, ref, precision, precs, device)
        out["ok"] = (
            bool(out["layouts"])
            and all(r["ok"] for r in out["layouts"].values())
            and all(f["caught"] for f in out["faults"].values())
            and len(out["faults"]) == len(FAULTS)
        )
        return out
    finally:
        if tmp is not None:
            tmp.cleanup()


def _memory(layout: Layout, model_dir: Path, samples: list, precision: str, peak: dict) -> dict[str, Any]:
    """The allocator's peak beside the cost model's bytes (:mod:`.layout_memory`)."""
    try:
        predicted = predicted_bytes(layout, model_dir, samples, precision)
    except Exception as exc:  # a strategy that states no cost: the measurement still stands
        return {**peak, "predicted_bytes": None, "predicted": f"{type(exc).__name__}: {exc}"}
    return memory_record(peak, predicted)


def ref_dtype(precision: str) -> torch.dtype:
    from disagg.interfaces.precision import RECIPES

    return RECIPES[precision].weights


def _describe(spec: tuple[str, dict]) -> str:
    name, options = spec
    opts = ", ".join(f"{k}={v}" for k, v in options.items())
    return f"{name}({opts})" if opts else name


def self_tests(
    layout: Layout | None,
    registry: Any,
    families: dict,
    samples: list,
    ref: Any,
    precision: str,
    precs: dict,
    device: torch.device,
) -> dict[str, dict[str, Any]]:
    """Each fault injected into ``layout``'s run: caught when the comparison fails."""
    if layout is None:
        return {f: {"caught": False, "why": "no layout passed to inject it into"} for f in FAULTS}
    uncaught = os.environ.get(UNCAUGHT_ENV, "")
    out = {}
    for fault in FAULTS:
        injected = fault != uncaught
        got = run_layout(
            layout, registry, families, samples, STEPS, OPTIM, precision, device, fault if injected else None
        )
        res = compare(got, ref, precision, OPTIM, precs)
        out[fault] = {
            "layout": layout.name,
            "injected": injected,
            "caught": not res["ok"],
            "margins": res["margins"],
            "first_failure": res["failures"][0] if res["failures"] else None,
        }
    return out
