"""Rank function of the optimizer-offload tests (importable by spawned ranks): every first-party
strategy in the issue's layouts, each under ``fp32`` and ``bf16``, without and with
``offload: optimizer``, 3 steps of 2 microbatches each (weight decay on), recording at every step
the loss, the merged gradients and the merged parameters after the step; then each layout resumed
with offload from the state a run without offload wrote after 2 steps. One spawn of 2 ranks for
all of it.

Layouts: ``ddp`` over 2 replicas and ``ulysses`` degree 2 with ``shard: parameters`` (the tiny
LLaVA tower, squared error to fixed targets), ``megatron_tp`` degree 2 with sequence parallelism
(the tiny Qwen2 LM), ``zero`` stages 1 and 3 (the toy LM).

``offload: activations`` (:data:`ACTIVATION_RUNS`): the kit's three layouts under ``recompute: full``
without and with the blocks' kept inputs in host memory, in ``fp32``; ``megatron_tp`` also under
``bf16`` with ``offload: optimizer`` against ``offload: all``. Each microbatch's saved bytes are
counted as the worker counts them (device peak, and the bytes the offload hooks moved to the host).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from disagg.interfaces import OptimSpec
from disagg.kit.offload import resident_bytes
from disagg.kit.recompute.activations import saved_bytes_hooks
from disagg.testing import ranks

STEPS = 3
MICROBATCHES = 2
#: (``zero`` under ``bf16-pure`` cannot offload: DeepSpeed asserts that bf16 masters offload only
#: with its own ``DeepSpeedCPUAdam`` as the optimizer, stages 1-2's ``_enforce_cpu_offload`` and
#: stage 3's ``_enforce_optimizer_offload``, not the strategy's MaskedAdamW; validation refuses it)
PRECISIONS = ("fp32", "bf16")
LAYOUTS = ("ddp", "ulysses-fsdp", "megatron_tp-sp", "zero-1", "zero-3")
#: weight decay on (DESIGN.md's test data); eps above bf16's gradient noise
OPTIM = OptimSpec(lr=1e-3, eps=1e-3, weight_decay=0.1)
#: ``offload: activations`` runs: (layout, precision, the offload value compared, against this one)
ACTIVATION_RUNS = (
    ("ddp", "fp32", "activations", "none"),
    ("ulysses", "fp32", "activations", "none"),
    ("megatron_tp-sp", "fp32", "activations", "none"),
    ("megatron_tp-sp", "bf16", "all", "optimizer"),
)
PER_LAYER = {
    "stage3_param_persistence_threshold": 0,
    "stage3_prefetch_bucket_size": 0,
    "stage3_max_reuse_distance": 0,
}


def resume_precision(layout: str) -> str:
    """The recipe a layout's resume runs in: ``bf16`` (the masters are what the state holds), for
    every layout (``zero`` stage 1 too, since its bf16 run over 2 microbatches is right)."""
    return "bf16"


def _strategy(
    layout: str,
    rank: int,
    precision: str,
    offload: bool | str,
    paths: dict[str, str],
    recompute: str = "none",
    more: dict[str, Any] | None = None,
) -> Any:
    """``more``: further ``parallel.<module>`` keys (``mlp_tiles``: tests/tiles_cases.py)."""
    value = "optimizer" if offload is True else offload or "none"
    extra = {"offload": value, "recompute": recompute, **(more or {})}
    if layout in ("ddp", "ulysses-fsdp", "ulysses"):
        from disagg.builtin.ddp import DDPStrategy
        from disagg_vision_sp.families.llava import LlavaVision
        from disagg_vision_sp.ulysses.strategy import UlyssesStrategy

        degree, replicas = (1, 2) if layout == "ddp" else (2, 1)
        cls, options = (DDPStrategy, {}) if layout == "ddp" else (UlyssesStrategy, {"shard": "parameters"})
        if layout == "ulysses":
            options = {}
        family: Any = LlavaVision(Path(paths["llava"]), {"attn_implementation": "eager"})
        module = "vision"
    elif layout in ("megatron_tp-sp", "megatron_tp"):
        from disagg_llm_tp.families.qwen2 import Qwen2Family
        from disagg_llm_tp.strategy import MegatronTPStrategy

        degree, replicas, cls = 2, 1, MegatronTPStrategy
        options = {"sequence_parallel": layout == "megatron_tp-sp"}
        family, module = Qwen2Family(paths["qwen2"], {"attn_implementation": "eager"}), "llm"
    else:
        from disagg.testing.toy import ToyLMFamily
        from disagg_zero import ZeroStrategy

        stage = int(layout[-1])
        degree, replicas, cls = 1, 2, ZeroStrategy
        options = {"stage": stage, **({"ds_config": {"zero_optimization": PER_LAYER}} if stage == 3 else {})}
        family, module = ToyLMFamily(Path(paths["toy_lm"])), "llm"
    ctx = ranks.rank_context(module, rank, degree, replicas, seed=5, precision=precision)
    strat = ranks.strategy_rank(cls, family, ctx, options={**options, **extra}, optim=OPTIM)
    strat.module.eval()  # compare arithmetic, not dropout masks
    return strat


def _counted(strat: Any, run: Callable[[int], float], out: dict[str, Any]) -> Callable[[int], float]:
    """``run`` with each microbatch's saved bytes counted as the worker counts them
    (:func:`disagg.kit.recompute.activations.saved_bytes_hooks`): the device peak (held + the
    replayed block's transient) and what the offload hooks moved to host memory."""

    def counted(mb: int) -> float:
        c = {"live": 0, "peak": 0, "host": 0}

        def add(n: int) -> None:
            c["live"] += n
            c["peak"] = max(c["peak"], c["live"])

        def peak(n: int) -> None:
            c["peak"] = max(c["peak"], c["live"] + n)

        def host(n: int) -> None:
            c["host"] += n

        with saved_bytes_hooks(strat.module, add, peak, host):
            loss = run(mb)
        out.setdefault("saved", []).append({"device": c["peak"], "host": c["host"]})
        return loss

    return counted


def _microbatch(layout: str, strat: Any, data: dict[str, Any]) -> Callable[[int], float]:
    """Microbatch ``mb``'s forward and backward on this rank; its part of the loss."""
    ctx = strat.ctx
    if layout in ("ddp", "ulysses-fsdp", "ulysses"):
        inputs, targets = data["images"], data["targets"]

        def encoder(mb: int) -> float:
            idx = [i for i in range(len(inputs)) if i % MICROBATCHES == mb]
            if layout == "ddp":  # replicas read different samples: uneven (2 and 1, or 1 and 0)
                idx = idx[: (len(idx) + 1) // 2] if ctx.replica == 0 else idx[(len(idx) + 1) // 2 :]
            shards = ranks.encode(strat, mb, [inputs[i] for i in idx])
            diffs = [s.value.float() - targets[i][s.positions] for s, i in zip(shards, idx)]
            ranks.backward(strat, mb, shards, [d.detach() for d in diffs])
            return float(sum(0.5 * d.detach().double().pow(2).sum() for d in diffs))

        return encoder
    samples, embeds = data["samples"], data["embeds"]
    total = sum(int((s["labels"][1:] != -100).sum()) for s in samples)

    def llm(mb: int) -> float:
        idx = [i for i in range(len(samples)) if i % MICROBATCHES == mb]
        if layout.startswith("zero"):  # 2 replicas: uneven halves
            idx = idx[: (len(idx) + 1) // 2] if ctx.rank == 0 else idx[(len(idx) + 1) // 2 :]
        rows = ranks.leaves([{k: v.to(ctx.dtype) for k, v in embeds[i].items()} for i in idx])
        return ranks.loss_and_backward(strat, mb, [samples[i] for i in idx], rows, 1.0 / total)

    return llm


def _train(
    layout: str, strat: Any, data: dict[str, Any], steps: range, out: dict[str, Any], count: bool = False
) -> None:
    """``steps`` steps (each 2 microbatches, reduce, norm, step) recording each step's loss, merged
    gradients and parameters; and, at the last step, what the rank holds where (``count``: each
    microbatch's saved bytes, :func:`_counted`)."""
    run_mb = _microbatch(layout, strat, data)
    if count:
        run_mb = _counted(strat, run_mb, out)
    copies = 2 if layout.startswith("megatron_tp") else 1  # the TP ranks hold the same loss
    for step in steps:
        part = torch.tensor([sum(run_mb(mb) for mb in range(MICROBATCHES))], dtype=torch.float64)
        dist.all_reduce(part)
        out.setdefault("loss", []).append(float(part) / copies)
        norm_sq = ranks.reduce(strat)
        out.setdefault("norm", []).append(norm_sq)
        out.setdefault("grads", []).append(ranks.full_grads(strat))
        ranks.step(strat, norm_sq, max_norm=0.5, zero_grad=False)  # clipping on
        if step == steps[-1] and layout.startswith("zero"):
            out["deepspeed"] = deepspeed_offload(strat)
        if step == steps[-1] and not layout.startswith("zero"):
            out["resident"] = resident_bytes(strat)  # gradients still held: the step's peak state
            census = ranks.state_census(strat)  # stepped (AdamW state) and idle (no gradient) elements
            with strat.masters():
                state = strat.optimizer.state
                stepped = [p for p in strat.module.parameters() if p.requires_grad and state.get(p)]
            out.update(census, shapes=[tuple(p.shape) for p in stepped], tensors=len(stepped))
        ranks.zero_grad(strat)
        out.setdefault("params", []).append(ranks.full_state(strat))


def deepspeed_offload(strat: Any) -> dict[str, Any]:
    """Whether DeepSpeed's own optimizer offload runs: its config flag, its optimizer's (stage 3:
    ``offload_optimizer``, stages 1-2: ``cpu_offload``), the optimizer class it picked (stage 1
    under ``bf16`` is ``BF16_Optimizer`` without offload) and the device of its fp32 master
    partitions (the accelerator's without offload; on CPU both are ``cpu``)."""
    ds = strat.engine.optimizer
    own = getattr(ds, "offload_optimizer", None)
    own = getattr(ds, "cpu_offload", False) if own is None else own
    flats = getattr(ds, "fp32_partitioned_groups_flat", None) or getattr(
        ds, "single_partition_of_fp32_groups", []
    )
    return {
        "config": bool(strat.engine.zero_cpu_offload()),
        "optimizer_offloads": bool(own),
        "optimizer": type(ds).__name__,
        "master_devices": sorted({t.device.type for t in flats}),
    }


def offload_rank(rank: int, paths: dict[str, str], data: dict[str, dict[str, Any]]) -> bytes:
    out: dict[Any, Any] = {}
    for layout in LAYOUTS:
        d = data[
            "vision" if layout in ("ddp", "ulysses-fsdp") else "toy" if layout.startswith("zero") else "qwen2"
        ]
        for precision in PRECISIONS:
            for offload in (False, True):
                res: dict[str, Any] = {}
                strat = _strategy(layout, rank, precision, offload, paths)
                _train(layout, strat, d, range(STEPS - 1), res)
                if not offload and precision == resume_precision(layout):
                    # the state a checkpoint without offload holds after 2 steps (full form)
                    saved = (strat.full_state_dict(), strat.full_optimizer_state())
                _train(layout, strat, d, range(STEPS - 1, STEPS), res)
                out[(layout, precision, offload)] = res
        # resume with offload from the state written without it; its 3rd step
        strat = _strategy(layout, rank, resume_precision(layout), True, paths)
        strat.load_full_state(*saved)
        res = {"loaded": strat.full_state_dict()}
        _train(layout, strat, d, range(STEPS - 1, STEPS), res)
        out[(layout, "resumed")] = res
    activation_runs(rank, paths, data, out)
    return ranks.dumps(out)


def activation_runs(rank: int, paths: dict[str, str], data: dict[str, dict[str, Any]], out: dict) -> None:
    """:data:`ACTIVATION_RUNS`, 3 steps each, saved bytes counted; recorded under
    ``("activations", layout, precision, offload)``."""
    for layout, precision, value, against in ACTIVATION_RUNS:
        d = data["vision" if layout in ("ddp", "ulysses") else "qwen2"]
        for offload in (against, value):
            res: dict[str, Any] = {}
            strat = _strategy(layout, rank, precision, offload, paths, recompute="full")
            # Hugging Face checkpoints its layers only in training mode (both runs draw the same
            # dropout masks, if any: the same seeds, and the replay redraws its forward's)
            strat.module.train()
            _train(layout, strat, d, range(STEPS), res, count=True)
            # the module's planning shape, as the cost model sees it
            dir_ = Path(paths["llava" if layout in ("ddp", "ulysses") else "qwen2"])
            res["shape"] = type(strat.family).planning_shape(json.loads((dir_ / "config.json").read_text()))
            out[("activations", layout, precision, offload)] = res
