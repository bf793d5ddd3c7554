"""The building blocks strategies compose, importable by plugins (beside
:mod:`disagg.interfaces`, the contracts): the :class:`Strategy` base with its role
defaults for a module every rank holds whole (:mod:`disagg.kit.roles`), sharding
(:mod:`disagg.kit.sharding`), gradient reduction (:mod:`disagg.kit.grads`),
recompute and RNG replay (:mod:`disagg.kit.recompute`), fp32 master weights
(:mod:`disagg.kit.masters`), LoRA (:mod:`disagg.kit.lora`), the chunked loss, HF
helpers (:mod:`disagg.kit.hf`) and cost rules (:mod:`disagg.kit.cost`)."""

from disagg.kit.grads import agree_on_grads, all_reduce_bucketed, sum_of_squares
from disagg.kit.grads.buckets import bucket_sizes
from disagg.kit.recompute import Recompute
from disagg.kit.strategy import Strategy, clip_coefficient

__all__ = [
    "Recompute",
    "Strategy",
    "agree_on_grads",
    "all_reduce_bucketed",
    "bucket_sizes",
    "clip_coefficient",
    "sum_of_squares",
]
