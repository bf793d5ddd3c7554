"""Cost rules a strategy's :meth:`~disagg.interfaces.strategy.StrategySpec.estimate` builds
from: collective byte formulas and the state, activation and FLOP counts of a module held
whole (:mod:`.rules`), what trains under LoRA and frozen parts (:mod:`.training`), the
matmuls by shape (:mod:`.gemms`) and the assembled :class:`~disagg.interfaces.cost.Cost`
(:mod:`.assemble`)."""
