"""The small contracts between core and plugins: families, strategies, transports."""

from disagg.interfaces.context import GroupContext, OptimSpec
from disagg.interfaces.family import EncoderFamily, Family, LanguageFamily, LayerMap
from disagg.interfaces.shard import EmbeddingShard
from disagg.interfaces.strategy import Strategy, StrategyOptions
from disagg.interfaces.transport import Transport

__all__ = [
    "EmbeddingShard",
    "EncoderFamily",
    "Family",
    "GroupContext",
    "LanguageFamily",
    "LayerMap",
    "OptimSpec",
    "Strategy",
    "StrategyOptions",
    "Transport",
]
