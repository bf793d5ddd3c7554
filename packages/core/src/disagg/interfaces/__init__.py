"""The small contracts between core and plugins: families, strategies, transports, trackers."""

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
from disagg.interfaces.grads import agree_on_grads, all_reduce_bucketed, bucket_sizes, sum_of_squares
from disagg.interfaces.parts import PartGroup
from disagg.interfaces.precision import PRECISIONS, RECIPES, Recipe, compute_dtype, resolve_precision
from disagg.interfaces.recompute import Recompute
from disagg.interfaces.sequence import AttentionScope, SeqLayout, UlyssesFamily
from disagg.interfaces.shard import EmbeddingShard
from disagg.interfaces.strategy import ReplicatedOptions, Strategy, StrategyOptions
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
    "agree_on_grads",
    "all_reduce_bucketed",
    "bucket_sizes",
    "sum_of_squares",
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
    "Recompute",
    "PartGroup",
    "SeqLayout",
    "SequenceParallelRegions",
    "Strategy",
    "ReplicatedOptions",
    "StrategyOptions",
    "Tracker",
    "TrackerOptions",
    "Transport",
    "UlyssesFamily",
]
