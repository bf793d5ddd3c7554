"""The planner's step-time and memory model over strategies' own costs.

Each module's group reports its cost per rank through :meth:`Strategy.estimate`
(core's analytic model for the first-party strategies). The planner turns it
into time on a :class:`~disagg.plan.cluster.Cluster`:

- a group's time = its FLOPs per rank / (peak x MFU) + its collective bytes per
  rank / ring bandwidth (NVLink inside a node, the network when the group spans
  nodes) + the bytes it ships to the other group / the link between them. Tensor-
  and sequence-parallel collectives sit on the critical path, so nothing overlaps
  inside a group.
- groups combine per the step schedule: ``collocated`` groups share devices and
  run one after the other (sum); ``disaggregated`` groups under
  ``sequential`` also sum, and under ``encoders_ahead`` with ``M`` microbatches
  overlap as a two-stage pipeline: ``max(t) + min(t) / M`` (fill and drain).
- memory per device = state + saved activations of each group on it: the sum of
  the groups for ``collocated`` (a device holds one rank of every group), each
  group alone for ``disaggregated``; it must fit ``device_memory x usable``.

Every vision replica takes one sample per microbatch (``M = batch / vision
replicas``), as ``disagg bench`` runs it, so a rank holds one image's
activations at a time (``max_inflight`` of them under ``encoders_ahead``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disagg.interfaces import Cost, CostQuery, Strategy, StrategyOptions, VisionShape
from disagg.interfaces.cost import Shape
from disagg.plan.cluster import Cluster


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes."""

    #: module -> shape (encoders first, ``llm`` last)
    shapes: dict[str, Shape]
    #: patches per image entering the vision encoder
    vision_tokens: int
    #: text tokens per sample beside the image's rows
    text_tokens: int
    #: samples per optimizer step (``data.batch_size``)
    samples: int
    #: assume full activation recomputation
    recompute: bool = False
    #: microbatches an encoder rank holds under ``encoders_ahead`` (``train.max_inflight``)
    max_inflight: int = 2

    def seq_len(self, module: str) -> int:
        if module == "llm":
            return self.rows() + self.text_tokens
        return self.vision_tokens

    def rows(self) -> int:
        """Rows per sample the encoders hand the LLM."""
        return sum(self.vision_tokens // s.unit for m, s in self.shapes.items() if isinstance(s, VisionShape))


@dataclass(frozen=True)
class Group:
    """One module's choice: strategy, mesh, options."""

    module: str
    strategy: str
    degree: int
    replicas: int
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def ranks(self) -> int:
        return self.degree * self.replicas

    def label(self) -> str:
        opts = "".join(f",{k}={v}" for k, v in self.options)
        return f"{self.strategy}({self.degree}x{self.replicas}{opts})"

    def section(self) -> dict[str, Any]:
        """``parallel.<module>`` as ``disagg train`` reads it."""
        return {
            "strategy": self.strategy,
            "degree": self.degree,
            "replicas": self.replicas,
            **dict(self.options),
        }


@dataclass
class Layout:
    """A full candidate and, once evaluated, its predicted figures."""

    groups: dict[str, Group]
    placement: str
    microbatches: int
    schedule: str
    costs: dict[str, Cost] = field(default_factory=dict)
    #: per module: seconds of compute, collectives, cross-group transfer
    times: dict[str, dict[str, float]] = field(default_factory=dict)
    step_time_s: float = 0.0
    #: bytes per device, worst device
    memory_bytes: int = 0
    fits: bool = True
    #: measured by ``--profile`` (tokens/s), when it ran
    measured: dict[str, Any] | None = None

    def name(self) -> str:
        return " + ".join(f"{m}={g.label()}" for m, g in self.groups.items()) + f" [{self.placement}]"

    def parallel_section(self) -> dict[str, Any]:
        return {"placement": self.placement, **{m: g.section() for m, g in self.groups.items()}}

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name(),
            "parallel": self.parallel_section(),
            "train": {"microbatches": self.microbatches, "schedule": self.schedule},
            "step_time_s": self.step_time_s,
            "memory_bytes": self.memory_bytes,
            "fits": self.fits,
            "groups": {
                m: {**self.costs[m].to_dict(), "time_s": self.times[m]}
                for m in self.groups
                if m in self.costs
            },
            **({"measured": self.measured} if self.measured else {}),
        }


def module_cost(
    strategy_cls: type[Strategy],
    group: Group,
    options: StrategyOptions,
    work: Workload,
    layout: Layout,
    dtype: str,
) -> Cost | None:
    """The group's cost per rank from its strategy's own hook."""
    shape = work.shapes[group.module]
    vision = isinstance(shape, VisionShape)
    inflight = 1
    if vision and layout.schedule == "encoders_ahead":
        inflight = min(work.max_inflight, layout.microbatches)
    query = CostQuery(
        shape=shape,
        degree=group.degree,
        replicas=group.replicas,
        seq_len=work.seq_len(group.module),
        dtype=dtype,
        samples=work.samples,
        microbatches=layout.microbatches,
        inflight=inflight,
        exchanged_rows=None if vision else work.rows(),
        exchanged_width=None if vision else _encoder_width(work),
        recompute=work.recompute,
    )
    return strategy_cls.estimate(query, options)


def _encoder_width(work: Workload) -> int | None:
    for s in work.shapes.values():
        if isinstance(s, VisionShape):
            return s.out_hidden
    return None


def evaluate(layout: Layout, costs: dict[str, Cost], cluster: Cluster) -> Layout:
    """Fill ``layout``'s time and memory from its groups' ``costs`` on ``cluster``."""
    layout.costs = costs
    rate = cluster.peak_flops * cluster.mfu
    total_ranks = sum(g.ranks for g in layout.groups.values())
    across = cluster.bandwidth(total_ranks if layout.placement == "disaggregated" else 1)
    for m, g in layout.groups.items():
        c = costs[m]
        layout.times[m] = {
            "compute_s": c.flops / rate,
            "collective_s": sum(c.comm_bytes_by_kind.values()) / cluster.bandwidth(g.ranks),
            "transfer_s": c.sent_bytes / across,
        }
    per = {m: sum(t.values()) for m, t in layout.times.items()}
    encoders = [per[m] for m in layout.groups if m != "llm"]
    if layout.placement == "disaggregated" and layout.schedule == "encoders_ahead" and encoders:
        stages = [sum(encoders), per["llm"]]
        layout.step_time_s = max(stages) + min(stages) / layout.microbatches
    else:
        layout.step_time_s = sum(per.values())
    mems = [c.memory_bytes for c in costs.values()]
    layout.memory_bytes = sum(mems) if layout.placement == "collocated" else max(mems)
    layout.fits = layout.memory_bytes <= cluster.memory_budget
    return layout
