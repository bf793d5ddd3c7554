"""``predict``: one module's cost per rank per optimizer step, from its strategy's own hook."""

from __future__ import annotations

from typing import Any

from disagg.interfaces.cost import Cost, CostQuery, Shape
from disagg.interfaces.lora import LoraSpec


def predict(
    module: Shape,
    strategy: str,
    degree: int,
    replicas: int,
    seq_len: int,
    precision: str = "fp32",
    *,
    samples: int | None = None,
    microbatches: int = 1,
    inflight: int = 1,
    options: dict[str, Any] | None = None,
    exchanged_rows: int | None = None,
    exchanged_width: int | None = None,
    recompute: str | bool = "none",
    strategies: dict[str, Any] | None = None,
    lora: LoraSpec | None = None,
    frozen: tuple[str, ...] = (),
) -> Cost:
    """Cost of ``module`` under ``strategy`` on ``degree x replicas`` ranks, for a
    global batch of ``samples`` (default: one per replica) sequences of
    ``seq_len`` tokens in ``microbatches``, as the strategy's ``estimate`` states it, under the
    ``precision`` recipe (``train.precision`` resolved: ``fp32``, ``bf16``, ``bf16-pure``).

    ``options``: the strategy's ``parallel.<module>`` keys; ``recompute``:
    ``parallel.<module>.recompute``; ``lora`` / ``frozen``: ``train.modules.<module>.lora``
    resolved and the frozen parts' patterns (:mod:`disagg.kit.cost.training`);
    ``strategies``: name -> class (default: the installed plugins'). An unknown strategy,
    or one that states no cost for this module, is a clear error."""
    if strategies is None:
        from disagg.plugins import get_registry

        strategies = get_registry().strategies
    cls = strategies.get(strategy)
    if cls is None:
        raise ValueError(f"unknown strategy {strategy!r}; installed: {', '.join(sorted(strategies))}")
    query = CostQuery(
        shape=module,
        degree=degree,
        replicas=replicas,
        seq_len=seq_len,
        precision=precision,
        samples=samples,
        microbatches=microbatches,
        inflight=inflight,
        exchanged_rows=exchanged_rows,
        exchanged_width=exchanged_width,
        recompute=recompute,
        lora=lora,
        frozen=tuple(frozen),
    )
    cost = cls.estimate(query, cls.options_model(**(options or {})))
    if cost is None:
        raise ValueError(f"strategy {strategy!r} states no cost for a {module.kind} module")
    return cost
