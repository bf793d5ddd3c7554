"""Analytic cost of a parallel layout, asked of the strategies themselves.

Each strategy states its own cost (:meth:`disagg.kit.Strategy.estimate`,
in its package's ``cost.py``) from a module shape that the module's family
describes (``Family.planning_shape``); the shared formulas are in
:mod:`disagg.kit.cost.rules`. This package only asks: :func:`predict`
evaluates one strategy's hook by name, :func:`shapes_for` reads module shapes
through the families. ``disagg bench`` prints the figures beside its
measurements; ``disagg plan`` ranks layouts with them. Which figures are exact
is stated per :class:`Cost` (``Cost.exact``).
"""

from disagg.cost.predict import predict
from disagg.cost.shapes import shapes_for
from disagg.interfaces.cost import (
    DTYPE_BYTES,
    Cost,
    DecoderShape,
    EncoderShape,
    ParamTensor,
    Shape,
    VisionShape,
)

__all__ = [
    "DTYPE_BYTES",
    "Cost",
    "DecoderShape",
    "EncoderShape",
    "ParamTensor",
    "Shape",
    "VisionShape",
    "predict",
    "shapes_for",
]
