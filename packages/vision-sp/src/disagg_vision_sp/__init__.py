"""disagg-vision-sp: the ``ulysses`` strategy and the vision families."""

from disagg_vision_sp.ulysses.layout import SeqLayout, UlyssesFamily, plan_bounds
from disagg_vision_sp.ulysses.strategy import UlyssesStrategy

__all__ = ["SeqLayout", "UlyssesFamily", "UlyssesStrategy", "plan_bounds"]
