"""Each group's model FLOPs of a step, counted on the driver from the batch's token counts and
the modules' shapes (no tensor is touched, no actor asked).

The count is the one the strategies' cost hooks state for a sample (every first-party
``estimate``: ``train_flops + cost_training.flops_delta``, then ``extra_flops`` for the
recompute replay; :mod:`disagg.kit.cost.rules`), evaluated per sample at its own length
and summed over the global batch: each sample is processed by exactly one replica of each
group, and the ranks that share it split its work, so the group's total does not depend on the
layout. What the model leaves out is stated in ``cost_rules``: element-wise work (norms,
softmax, activations, the loss's log-softmax) and the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from disagg.interfaces.lora import LoraSpec
from disagg.interfaces.shapes import EncoderShape, Shape
from disagg.kit.cost import training as cost_training
from disagg.kit.cost.rules import extra_flops, recompute_mode, train_flops


def sample_flops(
    shape: Shape,
    tokens: int,
    recompute: str = "none",
    lora: LoraSpec | None = None,
    frozen: tuple[str, ...] = (),
) -> float:
    """Training FLOPs of one sample of ``tokens`` tokens entering the module (an encoder's
    patches or frames; the LLM's sequence), as a strategy's cost hook counts ``work``."""
    if tokens <= 0:
        return 0.0
    work = train_flops(shape, tokens)
    if lora is not None or frozen:
        work += cost_training.flops_delta(cost_training.trained(shape, lora, frozen), tokens)
    return work + extra_flops(shape, tokens, work, recompute_mode(recompute))


@dataclass(frozen=True)
class ModuleFlops:
    """One module's shape and what changes its count (``parallel.<m>.recompute``, LoRA, frozen parts)."""

    shape: Shape
    recompute: str = "none"
    lora: LoraSpec | None = None
    frozen: tuple[str, ...] = ()

    def tokens_in(self, rows: int) -> int:
        """Tokens entering an encoder that produces ``rows`` placeholder rows (``unit`` per row)."""
        return rows * self.shape.unit if isinstance(self.shape, EncoderShape) else rows

    def sample(self, tokens: int) -> float:
        return sample_flops(self.shape, tokens, self.recompute, self.lora, self.frozen)


class StepFlops:
    """Per group, the model FLOPs of a global batch (:meth:`step`)."""

    def __init__(self, modules: dict[str, ModuleFlops], llm: str = "llm") -> None:
        self.modules, self.llm = modules, llm
        self._seen: dict[tuple[str, int], float] = {}  # lengths repeat from step to step

    def sample(self, module: str, tokens: int) -> float:
        key = (module, tokens)
        if key not in self._seen:
            self._seen[key] = self.modules[module].sample(tokens)
        return self._seen[key]

    def step(self, batch: list[Any]) -> dict[str, float]:
        """``batch``: :class:`~disagg.data.types.SampleRefs` (their token counts only)."""
        out: dict[str, float] = {}
        for m, mf in self.modules.items():
            if m == self.llm:
                out[m] = sum(self.sample(m, s.num_tokens) for s in batch)
            else:
                out[m] = sum(self.sample(m, mf.tokens_in(s.num_media_tokens.get(m, 0))) for s in batch)
        return out

    @classmethod
    def for_config(cls, cfg: Any, registry: Any) -> tuple[StepFlops | None, str]:
        """From a validated config: each module's shape as its family describes it from its model
        dir, ``recompute``, LoRA and frozen parts as the run resolves them. ``(None, why)`` when a
        family describes no shape (``Family.planning_shape``): the run logs no ``flops``."""
        from disagg.plan.workload import config_shapes, config_training

        try:
            shapes = config_shapes(cfg, registry)
            lora, frozen = config_training(cfg, registry) if cfg.train.modules else ({}, {})
        except Exception as exc:  # noqa: BLE001 (a figure of the metrics never stops a run)
            return None, f"no per-group flops/mfu: {exc}"
        modules = {
            m: ModuleFlops(shapes[m], getattr(cfg.parallel, m).recompute, lora.get(m), frozen.get(m, ()))
            for m in cfg.modules()
        }
        return cls(modules), ""


@dataclass
class FlopCounting:
    """What a run's driver needs for ``flops`` and ``mfu``: the FLOP count and the peak."""

    flops: StepFlops | None
    #: one device's peak FLOP/s in the run's precision (:func:`disagg.metrics.peak.device_peak`)
    peak: float | None

    def step(self, batch: list[Any]) -> tuple[dict[str, float], float | None]:
        return (self.flops.step(batch) if self.flops is not None else {}), self.peak


def flop_counting(cfg: Any, registry: Any, device: str, precision: str) -> FlopCounting:
    """A run's :class:`FlopCounting`, with where its peak comes from (or why there are no
    ``flops``) noted in the run's log (``train.log``)."""
    import logging

    import ray

    from disagg.metrics.peak import device_peak

    log = logging.getLogger("disagg.metrics")
    flops, why = StepFlops.for_config(cfg, registry)
    if flops is None:
        log.info(why)
    peak, source = device_peak(device, precision, ray.cluster_resources() if ray.is_initialized() else {})
    log.info(f"mfu: peak per device {source}")
    return FlopCounting(flops, peak)


__all__ = ["FlopCounting", "ModuleFlops", "StepFlops", "flop_counting", "sample_flops"]
