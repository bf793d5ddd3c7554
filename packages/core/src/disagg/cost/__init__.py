"""Analytic cost of a parallel layout, from a model's config values alone.

Pure functions of a model shape (:func:`shapes_from_hf_config`), a strategy
(``ddp``, ``ulysses``, ``megatron_tp`` with or without sequence parallelism,
``zero`` stage 1/2/3), its degree and replicas, and the sequence length: bytes
each rank sends per step by collective kind (:mod:`.comm`), parameter +
gradient + optimizer bytes and saved-activation bytes per rank (:mod:`.memory`),
FLOPs (:mod:`.flops`). ``disagg bench`` prints them beside its measurements and
predicts what a machine cannot run; a planner can rank layouts with them.

Which figures are exact is stated per :class:`Cost` (``Cost.exact``) and in
each formula's docstring: vision-group communication under ``ulysses``,
``megatron_tp`` (without sequence parallelism) and ``ddp`` equals what
:class:`disagg.interfaces.CommCounter` counts, byte for byte (``zero``: the
strategy's own analytic count, within 0.2% of what it reports); state bytes
are exact except under ``zero``; fp32 saved activations of the Qwen2.5-VL
tower are exact under ``ddp``/``ulysses``/``megatron_tp``; the rest are estimates.
"""

from disagg.cost.predict import DTYPE_BYTES, STRATEGIES, Cost, predict
from disagg.cost.shapes import DecoderShape, ParamTensor, Shape, VisionShape, shapes_from_hf_config

__all__ = [
    "DTYPE_BYTES",
    "STRATEGIES",
    "Cost",
    "DecoderShape",
    "ParamTensor",
    "Shape",
    "VisionShape",
    "predict",
    "shapes_from_hf_config",
]
