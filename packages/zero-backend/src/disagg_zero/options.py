"""``parallel.<module>`` keys of the ``zero`` strategy."""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import ConfigDict, PositiveInt, field_validator, model_validator

from disagg.interfaces import StrategyOptions

STAGES = (1, 2, 3)

#: ds_config keys the strategy owns: setting them would break the equivalence
#: with the single-process model (see ``disagg_zero.dsconfig``).
RESERVED_KEYS: dict[str, str] = {
    "optimizer": "the optimizer comes from train.lr/betas/eps/weight_decay",
    "scheduler": "the schedule comes from train.scheduler/warmup_steps",
    "gradient_clipping": "clipping uses the global norm over all modules (train.clip_grad_norm)",
    "gradient_accumulation_steps": "accumulation follows train.microbatches",
    "train_batch_size": "the batch comes from data.batch_size",
    "train_micro_batch_size_per_gpu": "the batch comes from data.batch_size",
    "gradient_allreduce_op": "gradients must be summed, which the strategy arranges",
    "fp16": "fp16 loss scaling is not supported; train.precision selects fp32, bf16 or bf16-pure",
    "bf16": "train.precision selects DeepSpeed's bf16 mode (fp32, bf16, bf16-pure)",
    "communication_data_type": "train.precision decides the dtype gradients are reduced in",
    "data_types": "train.precision decides the dtype gradients are accumulated in",
}


class ZeroOptions(StrategyOptions):
    """Options of ``parallel.<module>`` when ``strategy: zero``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    stage: int = 2
    """ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters."""
    offload_optimizer: bool = False
    """Keep optimizer states (and the fp32 master weights) in CPU memory."""
    reduce_bucket_size: PositiveInt | None = None
    """Elements per gradient reduction bucket (DeepSpeed's default when unset)."""
    allgather_bucket_size: PositiveInt | None = None
    """Elements per parameter all-gather bucket, stages 1-2 (DeepSpeed's default when unset)."""
    overlap_comm: bool | None = None
    """Overlap gradient reduction with backward (DeepSpeed's default when unset)."""
    activation_checkpointing: bool | None = None
    """Deprecated spelling of ``parallel.<module>.recompute: full`` (core's key, which every
    strategy applies): ``true`` warns and means ``recompute: full``."""
    ds_config: dict[str, Any] = {}
    """Anything else, merged into the DeepSpeed config last
    (e.g. ``{zero_optimization: {stage3_prefetch_bucket_size: 0}}``)."""

    @model_validator(mode="after")
    def _deprecated_activation_checkpointing(self) -> ZeroOptions:
        if self.activation_checkpointing:
            warnings.warn(
                "strategy 'zero': activation_checkpointing is deprecated; it now means "
                "parallel.<module>.recompute: full (write that instead)",
                FutureWarning,
                stacklevel=2,
            )
            if self.recompute == "none":
                self.recompute = "full"
        return self

    @model_validator(mode="after")
    def _offload_is_offload_optimizer(self) -> ZeroOptions:
        # core's ``offload: optimizer`` and DeepSpeed's spelling name the same thing
        if self.offload in ("optimizer", "all"):
            self.offload_optimizer = True
        elif self.offload_optimizer:
            self.offload = "all" if self.offload == "activations" else "optimizer"
        return self

    @field_validator("stage", mode="before")
    @classmethod
    def _known_stage(cls, v: Any) -> int:
        if isinstance(v, bool) or v not in STAGES:
            raise ValueError(f"unknown ZeRO stage {v!r}; allowed: 1, 2, 3")
        return int(v)

    @field_validator("ds_config")
    @classmethod
    def _no_reserved_keys(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key, why in RESERVED_KEYS.items():
            if key in v:
                raise ValueError(f"ds_config.{key} cannot be set: {why}")
        zero = v.get("zero_optimization", {})
        if not isinstance(zero, dict):
            raise ValueError(f"ds_config.zero_optimization must be a mapping, got {zero!r}")
        if "stage" in zero:
            raise ValueError(
                "ds_config.zero_optimization.stage cannot be set: use the `stage` option (1, 2, 3)"
            )
        return v
