"""What a strategy's cost hook (:meth:`Strategy.estimate`) receives and returns.

The planner (``disagg plan``) asks every registered strategy, for one module
and one candidate mesh, what a rank would hold and move per optimizer step.
Plugins reach the analytic model through this module only: the shapes and the
:class:`Cost` they return are core's (``disagg.cost``), re-exported here, and
:func:`analytic_cost` evaluates core's formulas for a strategy whose collectives
match one of core's (``ddp``, ``ulysses``, ``megatron_tp``, ``zero``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from disagg.cost import Cost, DecoderShape, ParamTensor, Shape, VisionShape, predict, shapes_from_hf_config


@dataclass(frozen=True)
class CostQuery:
    """One module on one candidate mesh, for one optimizer step."""

    #: the module's shape from its config values (``VisionShape`` / ``DecoderShape``)
    shape: Shape
    degree: int
    replicas: int
    #: tokens per sample entering the module (vision: patches per image)
    seq_len: int
    #: compute dtype: ``float32`` or ``bfloat16`` (state stays fp32 either way)
    dtype: str = "bfloat16"
    #: samples in the global batch (default: one per replica)
    samples: int | None = None
    #: microbatches per step (``train.microbatches``)
    microbatches: int = 1
    #: microbatches whose activations a rank holds at once
    inflight: int = 1
    #: rows per sample shipped to / received from the other group, and their width
    exchanged_rows: int | None = None
    exchanged_width: int | None = None
    #: ``parallel.<module>.recompute``: ``none``, ``full`` (each block keeps only its
    #: input) or ``selective`` (the attention core); ``True`` is the old spelling of ``full``
    recompute: str | bool = "none"


def analytic_cost(strategy: str, query: CostQuery, options: dict[str, Any] | None = None) -> Cost:
    """Core's analytic model (:func:`disagg.cost.predict`) for ``query`` under
    one of core's strategy formulas (``ddp``, ``ulysses``, ``megatron_tp``, ``zero``)."""
    return predict(
        query.shape,
        strategy,
        query.degree,
        query.replicas,
        query.seq_len,
        query.dtype,
        samples=query.samples,
        microbatches=query.microbatches,
        inflight=query.inflight,
        options=options,
        exchanged_rows=query.exchanged_rows,
        exchanged_width=query.exchanged_width,
        recompute=query.recompute,
    )


__all__ = [
    "Cost",
    "CostQuery",
    "DecoderShape",
    "ParamTensor",
    "Shape",
    "VisionShape",
    "analytic_cost",
    "shapes_from_hf_config",
]
