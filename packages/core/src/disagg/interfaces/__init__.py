"""The contracts between core and plugins: families, strategy specs, the context and
state types a strategy sees, cost types, schedules, transports, trackers, precision
recipes. Nothing here is an implementation: the building blocks strategies compose
(sharding, gradient reduction, recompute, masters, LoRA, cost rules, the
:class:`~disagg.kit.Strategy` base with its role defaults) are in :mod:`disagg.kit`."""

from disagg.interfaces.comm import CommCounter
from disagg.interfaces.context import GroupContext, OptimSpec, dropout_seed
from disagg.interfaces.cost import Cost, CostQuery, DecoderShape, EncoderShape, VisionShape
from disagg.interfaces.family import (
    AttentionSpec,
    EncoderFamily,
    Family,
    LanguageFamily,
    LayerMap,
    SequenceParallelRegions,
)
from disagg.interfaces.parts import PartGroup
from disagg.interfaces.precision import PRECISIONS, RECIPES, Recipe, compute_dtype, resolve_precision
from disagg.interfaces.sequence import AttentionScope, SeqLayout, UlyssesFamily
from disagg.interfaces.shard import EmbeddingShard
from disagg.interfaces.strategy import RankStrategy, ReplicatedOptions, StrategyOptions, StrategySpec
from disagg.interfaces.tracker import Tracker, TrackerOptions
from disagg.interfaces.transport import Layout, Transport

__all__ = [
    "AttentionScope",
    "AttentionSpec",
    "CommCounter",
    "Cost",
    "CostQuery",
    "DecoderShape",
    "EncoderShape",
    "VisionShape",
    "compute_dtype",
    "PRECISIONS",
    "RECIPES",
    "Recipe",
    "resolve_precision",
    "dropout_seed",
    "EmbeddingShard",
    "EncoderFamily",
    "Family",
    "GroupContext",
    "LanguageFamily",
    "LayerMap",
    "Layout",
    "OptimSpec",
    "PartGroup",
    "SeqLayout",
    "SequenceParallelRegions",
    "ReplicatedOptions",
    "StrategyOptions",
    "RankStrategy",
    "StrategySpec",
    "Tracker",
    "TrackerOptions",
    "Transport",
    "UlyssesFamily",
]
