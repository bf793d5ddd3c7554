"""The DeepSpeed config the ``zero`` strategy runs with, and its validation.

Settings here are what makes a ZeRO group equal the single-process model:

* no DeepSpeed clipping (``gradient_clipping: 0``): the driver clips with the
  global norm over every module, applied by the strategy;
* gradients are **summed** over ranks, because core's loss is already divided
  by the global label count. Stages 1-2 ask DeepSpeed for a sum
  (``gradient_allreduce_op: sum``); stage 3 only averages, so the strategy
  scales its backward seed by the world size (:func:`backward_scale`);
* one micro-batch per engine step as far as DeepSpeed is concerned; the
  strategy marks the accumulation boundary itself (core decides microbatches).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from disagg_zero.options import ZeroOptions

#: DeepSpeed's precision section per recipe of issue 25's ``train.precision`` (a key
#: core does not have yet: the strategy builds with ``fp32``, core's one dtype rule).
#: ``bf16``: bf16 weights for compute, fp32 master weights and AdamW state in
#: DeepSpeed's optimizer; ``bf16-pure``: master weights, gradients and optimizer
#: state in bf16 too. ``check_grad_overflow`` off: DeepSpeed would skip a step on its
#: own, which the single-process model never does (the driver's global norm decides).
PRECISION_SECTIONS: dict[str, dict[str, Any]] = {
    "fp32": {"enabled": False},
    "bf16": {"enabled": True, "check_grad_overflow": False},
    "bf16-pure": {
        "enabled": True,
        "check_grad_overflow": False,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    },
}


def build_ds_config(options: ZeroOptions, dtype: torch.dtype, precision: str = "fp32") -> dict[str, Any]:
    """DeepSpeed config dict for ``options`` (``ds_config`` merged last); ``precision``
    picks DeepSpeed's ``bf16`` section (:data:`PRECISION_SECTIONS`; only ``fp32`` runs
    today, the others are there for the precision recipe to switch on)."""
    if precision not in PRECISION_SECTIONS:
        raise ValueError(f"unknown precision {precision!r}; allowed: {', '.join(PRECISION_SECTIONS)}")
    zero: dict[str, Any] = {"stage": options.stage}
    if options.reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = options.reduce_bucket_size
    if options.allgather_bucket_size is not None:
        zero["allgather_bucket_size"] = options.allgather_bucket_size
    if options.overlap_comm is not None:
        zero["overlap_comm"] = options.overlap_comm
    if options.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "gradient_allreduce_op": "mean" if options.stage == 3 else "sum",
        # core's one dtype rule today (fp32): fp32 parameters and states, the forward
        # under autocast (disagg.interfaces.compute_dtype); DeepSpeed's bf16 mode keeps
        # bf16 parameters, which only a precision recipe for every strategy may ask for.
        "bf16": dict(PRECISION_SECTIONS[precision]),
        "zero_optimization": zero,
        # The optimizer is a torch AdamW (or DeepSpeedCPUAdam when offloading)
        # built from train.*; DeepSpeed must take it as given.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    return merge(cfg, options.ds_config)


def backward_scale(options: ZeroOptions, world_size: int) -> float:
    """Factor on the backward seed that turns DeepSpeed's reduction into a sum."""
    return float(world_size) if options.stage == 3 else 1.0


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; ``extra`` wins."""
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def persistence_threshold(options: ZeroOptions) -> int:
    """Elements at or under which ZeRO-3 keeps a parameter whole on every rank,
    as DeepSpeed reads its config (its default when ``ds_config`` sets none)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    section = build_ds_config(options, torch.float32)["zero_optimization"]
    return int(DeepSpeedZeroConfig(**section).param_persistence_threshold)


def gather_settings(options: ZeroOptions) -> dict[str, int]:
    """ZeRO-3's per-layer gathering knobs as DeepSpeed reads its config (elements):
    ``prefetch`` (stage3_prefetch_bucket_size), ``max_live`` (stage3_max_live_parameters),
    ``reuse`` (stage3_max_reuse_distance)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    z = DeepSpeedZeroConfig(**build_ds_config(options, torch.float32)["zero_optimization"])
    return {
        "prefetch": int(z.prefetch_bucket_size),
        "max_live": int(z.max_live_parameters),
        "reuse": int(z.max_reuse_distance),
    }


def zero_section_problems(options: ZeroOptions) -> list[str]:
    """What DeepSpeed's own schema says about ``zero_optimization`` (config time)."""
    from pydantic import ValidationError

    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ImportError as exc:  # deepspeed is a hard dependency; say so plainly
        return [f"strategy 'zero' needs deepspeed, which failed to import: {exc}"]
    section = build_ds_config(options, torch.float32)["zero_optimization"]
    try:
        DeepSpeedZeroConfig(**section)
    except ValidationError as exc:
        return [
            f"ds_config.zero_optimization.{'.'.join(str(p) for p in err['loc'])}: {err['msg']} "
            f"(got {err.get('input')!r}; DeepSpeed rejected it)"
            for err in exc.errors()
        ]
    return []
