"""A strategy's rank-side half: :class:`Strategy` is the class a strategy plugin subclasses,
the contract of :class:`~disagg.interfaces.strategy.StrategySpec` with the role defaults for a
module every rank holds whole (:mod:`disagg.kit.roles`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from disagg.interfaces.context import GroupContext
from disagg.interfaces.family import Family
from disagg.interfaces.strategy import StrategyOptions, StrategySpec
from disagg.kit.lockstep import Lockstep
from disagg.kit.offload import offloads_activations
from disagg.kit.recompute import Recompute
from disagg.kit.roles import EncoderRole, LanguageRole, Parallelizer, StateAdapter

__all__ = ["Strategy", "clip_coefficient"]


class Strategy(Parallelizer, EncoderRole, LanguageRole, StateAdapter, StrategySpec):
    """One rank's view of a parallelized module, made of roles (one file each,
    under :mod:`disagg.kit.roles`) with defaults for a module every rank
    holds whole:

    - :class:`~disagg.kit.roles.Parallelizer`: ``parallelize`` (the one
      method a strategy must write), ``setup``/``finish_setup``,
      ``reduce_gradients``, ``grad_norm_sq``, ``step``, ``zero_grad``, and the
      two hooks every forward and backward goes through: ``module_call`` (a
      context, e.g. gathering sharded parameters) and ``backprop`` (how
      gradients reach the parameters);
    - :class:`~disagg.kit.roles.EncoderRole`: ``encode``, ``backward``,
      ``release``;
    - :class:`~disagg.kit.roles.LanguageRole`: ``loss_and_backward``,
      ``evaluate``, ``loss_sum``, ``correct_predictions``, ``returns_input_grads``;
    - :class:`~disagg.kit.roles.StateAdapter`: the full form
      (``full_state_dict``, ``full_grads``, ``full_optimizer_state``,
      ``load_full_state``), sharded checkpoints (``tensor_layout``, ``local_tensor``, ``sharded_state``)
      and ``rng_state``/``set_rng_state``;
    - ``build_optimizer``: a callable (:mod:`disagg.kit.roles.optimizer`);
    - class level, before any actor starts (:class:`~disagg.interfaces.strategy.StrategySpec`):
      ``check``, ``estimate``, ``option_variants`` and the capability attributes.

    Lifecycle in the actor: ``__init__`` -> ``setup(build_module(), optim)`` -> per step
    (``encode`` & ``backward`` | ``loss_and_backward``)* -> ``reduce_gradients``
    -> ``grad_norm_sq`` -> ``step(clip_coef)`` -> ``zero_grad``.

    Gradient convention: the loss is already divided by the *global* label
    count, so gradients from different replicas and shards are **summed**
    across the group, exactly once per element.
    """

    def __init__(self, ctx: GroupContext, family: Family, options: StrategyOptions) -> None:
        self.ctx = ctx
        self.family = family
        self.options = options
        self.module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        #: this module's ``recompute`` (strategies add their streams and captures)
        self.recompute = Recompute(
            getattr(options, "recompute", "none"), offload=offloads_activations(options)
        )
        #: placeholder calls that keep the group's collectives in step (:mod:`disagg.kit.lockstep`)
        self.lockstep = Lockstep(family, ctx.dtype)


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` would apply."""
    if not max_norm or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
