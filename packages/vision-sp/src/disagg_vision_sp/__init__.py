"""disagg-vision-sp: the ``ulysses`` strategy and the vision families."""

from disagg_vision_sp.ulysses.layout import plan_bounds
from disagg_vision_sp.ulysses.strategy import UlyssesStrategy

# The family hook points (UlyssesFamily, SeqLayout) are imported from disagg.interfaces only.
__all__ = ["UlyssesStrategy", "plan_bounds"]
