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

from disagg_zero.options import ZeroOptions

#: DeepSpeed's own mode for each ``train.precision`` recipe (:mod:`disagg.interfaces.precision`):
#: its ``bf16`` section plus the dtypes it communicates and accumulates gradients in, merged
#: into the config. ``check_grad_overflow`` off: DeepSpeed would skip a step on its own, which
#: the single-process model never does (the driver's global norm decides).
#:
#: ``bf16``: DeepSpeed keeps the module's weights in bf16 and an fp32 master partition that
#: the optimizer steps; ``data_types.grad_accum_dtype: fp32`` makes it accumulate gradients in
#: fp32 and ``communication_data_type: fp32`` reduce them in fp32 (its default under ``bf16``
#: is to reduce in bf16). Per stage that is: stage 1 ``BF16_Optimizer`` (DeepSpeed's choice for
#: bf16 weights with fp32 accumulation: the whole fp32 gradient, all-reduced in fp32, fp32
#: master partition), stage 2 ``DeepSpeedZeroOptimizer`` with its fp32 gradient partition
#: (each microbatch's bf16 gradient reduced in fp32 into it), stage 3 the same partitions
#: with bf16 weight partitions.
#:
#: ``bf16-pure``: ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``: master,
#: gradients (accumulated and reduced in bf16) and AdamW moments in bf16. Stage 3's master is
#: the bf16 weight partition itself; stages 1-2 keep their master partition as a bf16 copy of
#: the weights' (same values, so the same updates; 2 bytes per element over the ranks more).
PRECISION_SECTIONS: dict[str, dict[str, Any]] = {
    "fp32": {"bf16": {"enabled": False}},
    "bf16": {
        "bf16": {"enabled": True, "check_grad_overflow": False},
        "communication_data_type": "fp32",
        "data_types": {"grad_accum_dtype": "fp32"},
    },
    "bf16-pure": {
        "bf16": {
            "enabled": True,
            "check_grad_overflow": False,
            "bf16_master_weights_and_grads": True,
            "bf16_optimizer_states": True,
        },
        "communication_data_type": "bf16",
        "data_types": {"grad_accum_dtype": "bf16"},
    },
}


def build_ds_config(options: ZeroOptions, precision: str = "fp32") -> dict[str, Any]:
    """DeepSpeed config dict for ``options`` (``ds_config`` merged last) under the
    ``train.precision`` recipe ``precision`` (:data:`PRECISION_SECTIONS`)."""
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
        **copy.deepcopy(PRECISION_SECTIONS[precision]),
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

    section = build_ds_config(options)["zero_optimization"]
    return int(DeepSpeedZeroConfig(**section).param_persistence_threshold)


def gather_settings(options: ZeroOptions) -> dict[str, int]:
    """ZeRO-3's per-layer gathering knobs as DeepSpeed reads its config (elements):
    ``prefetch`` (stage3_prefetch_bucket_size), ``max_live`` (stage3_max_live_parameters),
    ``reuse`` (stage3_max_reuse_distance)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    z = DeepSpeedZeroConfig(**build_ds_config(options)["zero_optimization"])
    return {
        "prefetch": int(z.prefetch_bucket_size),
        "max_live": int(z.max_live_parameters),
        "reuse": int(z.max_reuse_distance),
    }


def reduce_bucket_elements(options: ZeroOptions) -> int:
    """Elements of the gradient reduce bucket ZeRO-3 allocates at set-up and holds for the run
    (``stage3.py``: ``torch.empty(reduce_bucket_size)`` per communication dtype when
    ``contiguous_gradients``), as DeepSpeed reads the config built here; 0 when it allocates
    none (``contiguous_gradients: false``)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    z = DeepSpeedZeroConfig(**build_ds_config(options)["zero_optimization"])
    return int(z.reduce_bucket_size) if z.contiguous_gradients else 0


def zero_section_problems(options: ZeroOptions) -> list[str]:
    """What DeepSpeed's own schema says about ``zero_optimization`` (config time)."""
    from pydantic import ValidationError

    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ImportError as exc:  # deepspeed is a hard dependency; say so plainly
        return [f"strategy 'zero' needs deepspeed, which failed to import: {exc}"]
    section = build_ds_config(options)["zero_optimization"]
    try:
        DeepSpeedZeroConfig(**section)
    except ValidationError as exc:
        return [
            f"ds_config.zero_optimization.{'.'.join(str(p) for p in err['loc'])}: {err['msg']} "
            f"(got {err.get('input')!r}; DeepSpeed rejected it)"
            for err in exc.errors()
        ]
    return []


#: ``(train.precision, stage)`` pairs whose DeepSpeed ``offload_optimizer`` equals the run without it
#: (``tests/test_offload.py``: 3 steps x 2 microbatches, within the tight fp32 bound; stage 1 under
#: ``bf16`` then runs ``DeepSpeedZeroOptimizer`` with ``cpu_offload`` where the run without it is
#: ``BF16_Optimizer``); ``fp32`` at every stage
OFFLOAD_VERIFIED = {("bf16", 1), ("bf16", 3)}


def recipe_problems(recipe: str, options: ZeroOptions, where: str) -> list[str]:
    """The ``parallel.<module>`` settings (at ``where``) DeepSpeed cannot run exactly under the
    ``train.precision`` recipe ``recipe`` (sentences; config time)."""
    if recipe == "fp32" or not options.offload_optimizer or (recipe, options.stage) in OFFLOAD_VERIFIED:
        return []
    why = (
        # DeepSpeed asserts that bf16 masters offload only with exactly its DeepSpeedCPUAdam as the
        # optimizer (a type check: stage_1_and_2.py _enforce_cpu_offload, stage3.py
        # _enforce_optimizer_offload); the strategy's is MaskedAdamW (CPU) or a masked subclass of
        # DeepSpeedCPUAdam (GPU), which leave parameters without a gradient alone (optim.py)
        "DeepSpeed offloads bf16 master weights only with its own DeepSpeedCPUAdam as the optimizer, "
        "not the strategy's masked AdamW"
        if recipe == "bf16-pure"
        else "DeepSpeed's offloaded optimizer is verified against the run without it at stages 1 and 3 only"
    )
    return [
        f"train.precision: {recipe!r} cannot be combined with {where}.offload_optimizer: true "
        f"(strategy 'zero', {where}.stage: {options.stage}): {why}; set offload_optimizer: false or "
        "train.precision: fp32" + (" (or stage: 1 or 3)" if recipe == "bf16" else "")
    ]
