"""disagg-zero: the ``zero`` strategy, DeepSpeed ZeRO stages 1, 2 and 3 for any module."""

from disagg_zero.options import ZeroOptions
from disagg_zero.strategy import ZeroStrategy

__all__ = ["ZeroOptions", "ZeroStrategy"]
