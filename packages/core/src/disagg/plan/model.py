"""The planner's step-time and memory model over strategies' own costs.

Each module's group reports its cost per rank through :meth:`Strategy.estimate`
(each strategy's own formulas, in its package): FLOPs, bytes and calls
per collective kind, bytes shipped to the other group. The planner turns it
into time on a :class:`~disagg.plan.cluster.Cluster`, per group:

- ``compute_s``: each matmul and attention core the strategy states (``Cost.compute``)
  at the efficiency its shape reaches on the cluster, plus its element-wise bytes at
  the memory bandwidth (:mod:`disagg.plan.efficiency`); ``FLOPs / (peak x MFU)``
  where a cost states no shapes or the cluster has no curve.
- ``collective_s``, the α-β model (Thakur, Rabenseifner & Gropp, "Optimization
  of Collective Communication Operations in MPICH", 2005): each call of kind
  ``k`` over ``p`` ranks pays ``steps_k(p) · α`` (ring all-reduce ``2(p-1)``,
  all-gather / reduce-scatter / all-to-all ``p-1``, broadcast ``ceil(log2 p)``)
  and the bytes it sends pay ``1/bw``: ``Σ_k calls_k·steps_k(p)·α(p) + bytes/bw(p)``
  with α and bw of the slowest link the group spans (NVLink inside a node, the
  network across). Tensor- and sequence-parallel collectives sit on the critical
  path, so nothing overlaps inside a group.
- ``overhead_s``, what every microbatch pays whatever its size:
  ``M·(L+1)·δ + (2·M + 2)·γ``: ``L`` layers (blocks) plus the embedding/merger/
  head, forward + backward, at ``δ`` (``layer_overhead``: kernel launches,
  eager dispatch) each; two driver calls per microbatch (encode + backward, or
  loss_and_backward + release) and two per step (reduce_and_norm, step) at
  ``γ`` (``call_latency``). Where launches are asynchronous (GPUs) the host's
  ``M·(L+1)·δ`` runs under the device's work: only ``max(0, M·(L+1)·δ -
  compute_s)`` counts; on a CPU (eager, synchronous) all of it does.
- ``transfer_s = sent_bytes / bw_across + M·γ``: the rows (gradients) it
  ships to the other group, one object-store hop per microbatch (``shards_for``
  / ``grads_for``), over the link between the groups.

Groups combine per the step schedule: ``collocated`` groups share devices and
run one after the other (sum); ``disaggregated`` groups under ``sequential``
also sum, and under ``encoders_ahead`` with ``M`` microbatches overlap as a
two-stage pipeline: ``max(t) + min(t) / M`` (fill and drain), every term above
included. Memory per device = state + saved activations of each group on it:
the sum of the groups for ``collocated`` (a device holds one rank of every
group), each group alone for ``disaggregated``; it must fit ``device_memory x
usable``.

Every vision replica takes one sample per microbatch (``M = batch / vision
replicas``), as ``disagg bench`` runs it, so a rank holds one image's
activations at a time (``max_inflight`` of them under ``encoders_ahead``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from disagg.interfaces import Cost, CostQuery, EncoderShape, StrategyOptions
from disagg.interfaces.cost import Shape
from disagg.interfaces.lora import LoraSpec
from disagg.kit import Strategy
from disagg.kit.cost.activation_offload import offload_seconds as activation_offload_seconds
from disagg.kit.cost.memory import device_memory
from disagg.kit.cost.offload import offload_seconds
from disagg.plan.cluster import Cluster
from disagg.plan.efficiency import compute_seconds
from disagg.plan.extended import KEYS, GroupCost, extended_cost
from disagg.plan.feature_cache import cached_times


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
    #: plan only layouts that recompute activations, in modules whose strategy can
    #: (``--recompute``); otherwise ``recompute`` is searched per module like any key
    recompute: bool = False
    #: microbatches an encoder rank holds under ``encoders_ahead`` (``train.max_inflight``)
    max_inflight: int = 2
    #: encoder positions per sample entering an ``audio`` module (default: ``vision_tokens``)
    audio_tokens: int | None = None
    #: ``train.precision`` (a recipe name); None: the cluster's (``auto``)
    precision: str | None = None
    #: module -> ``train.modules.<m>.lora`` resolved (:class:`~disagg.interfaces.lora.LoraSpec`)
    lora: dict[str, LoraSpec] = field(default_factory=dict)
    #: module -> ``train.modules.<m>.freeze``'s parameter-name patterns
    frozen: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: strategy -> :class:`disagg.plan.extended.Traits`: offer ``context_parallel`` and ``offload``
    #: layouts for these strategies by the cost model alone, before their runtimes and cost hooks
    #: state the keys (analytic tables: the published setting, :data:`disagg.bench.published.MODELLED`)
    modelled: dict[str, Any] = field(default_factory=dict)
    #: offer the layout keys the strategies' own cost hooks state: ``context_parallel`` 2, 4, ...
    #: for the LLM under a strategy and family with ``context_parallel_support``, and the strategies'
    #: ``offload`` option variants on GPU clusters (``disagg plan`` and ``parallel: auto`` on a
    #: config; off where recorded plans are computed from a bare workload, which predate them)
    strategy_keys: bool = False
    #: module -> share of a step's samples a frozen, cached encoder still encodes
    #: (``parallel.<m>.feature_cache``: :mod:`disagg.plan.feature_cache`); absent: every one
    encoded: dict[str, float] = field(default_factory=dict)

    def seq_len(self, module: str) -> int:
        if module == "llm":
            return self.rows() + self.text_tokens
        if module == "audio" and self.audio_tokens is not None:
            return self.audio_tokens
        return self.vision_tokens

    def rows(self) -> int:
        """Rows per sample the encoders hand the LLM."""
        return sum(self.seq_len(m) // s.unit for m, s in self.shapes.items() if isinstance(s, EncoderShape))


@dataclass(frozen=True)
class Group:
    """One module's choice: strategy, mesh, options."""

    module: str
    strategy: str
    degree: int
    replicas: int
    options: tuple[tuple[str, Any], ...] = ()

    # cached: the search reads them for every one of (up to) millions of layouts
    def __hash__(self) -> int:  # the search's caches are keyed by groups: hashed once, not per look-up
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash((self.module, self.strategy, self.degree, self.replicas, self.options))

    @cached_property
    def context_parallel(self) -> int:
        return int(dict(self.options).get("context_parallel", 1) or 1)

    @cached_property
    def ranks(self) -> int:
        return self.degree * self.context_parallel * self.replicas

    def label(self) -> str:
        return self._label

    @cached_property
    def _label(self) -> str:  # every layout's name (the plan's tie-break) reads it
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
    #: per module: seconds of compute, collectives, fixed overhead, cross-group transfer
    times: dict[str, dict[str, float]] = field(default_factory=dict)
    step_time_s: float = 0.0
    #: bytes per device, worst device
    memory_bytes: int = 0
    fits: bool = True
    #: measured by ``--profile`` (tokens/s), when it ran
    measured: dict[str, Any] | None = None
    #: the worst device's memory by named term (:class:`disagg.kit.cost.memory.DeviceMemory`)
    memory_terms: dict[str, int] = field(default_factory=dict)
    #: host bytes per device of what is offloaded
    host_bytes: int = 0

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
            # the worst device's peak by term where the allocator's view is counted (GPU clusters)
            **({"memory_terms": dict(self.memory_terms)} if self.memory_terms else {}),
            **({"host_bytes_per_device": self.host_bytes} if self.host_bytes else {}),
            "fits": self.fits,
            "groups": {
                m: {
                    **self.costs[m].to_dict(),
                    # predicted busy seconds (metrics.jsonl's busy_s), and its parts
                    "busy_s": sum(self.times[m].values()),
                    "busy_s_by_part": dict(self.times[m]),
                    # the recompute the prediction assumed (what the plan writes)
                    "recompute": dict(self.groups[m].options).get("recompute", "none"),
                }
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
    precision: str,
) -> Cost | None:
    """The group's cost per rank from its strategy's own hook."""
    got = group_cost(strategy_cls, group, options, work, layout, precision)
    return None if got is None else got.cost


def group_cost(
    strategy_cls: type[Strategy],
    group: Group,
    options: StrategyOptions,
    work: Workload,
    layout: Layout,
    precision: str,
) -> GroupCost | None:
    """:func:`module_cost` with the group's allocator view and ``context_parallel`` / ``offload``
    (:mod:`disagg.plan.extended`, which asks the strategy's hook)."""
    shape = work.shapes[group.module]
    vision = isinstance(shape, EncoderShape)
    inflight = 1
    if vision and layout.schedule == "encoders_ahead":
        inflight = min(work.max_inflight, layout.microbatches)
    opts = dict(group.options)

    def ask(*, shape, degree, replicas, seq_len, samples, options, recompute, exchanged_rows):  # type: ignore[no-untyped-def]
        model = strategy_cls.options_model(**options) if options != base else options_obj
        query = CostQuery(
            shape=shape,
            degree=degree,
            replicas=replicas,
            seq_len=seq_len,
            precision=precision,
            samples=samples,
            microbatches=layout.microbatches,
            inflight=inflight,
            exchanged_rows=exchanged_rows,
            exchanged_width=None if vision else _encoder_width(work),
            recompute=recompute,
            lora=work.lora.get(group.module),
            frozen=work.frozen.get(group.module, ()),
        )
        return strategy_cls.estimate(query, model)

    base = {k: v for k, v in opts.items() if k not in KEYS}
    options_obj = options
    traits = work.modelled.get(group.strategy)
    if traits is None and work.strategy_keys:
        # the strategy states context_parallel and offload itself (disagg.plan.native)
        from disagg.plan.native import native_cost

        query = CostQuery(
            shape=shape,
            degree=group.degree,
            replicas=group.replicas,
            seq_len=work.seq_len(group.module),
            precision=precision,
            samples=work.samples,
            microbatches=layout.microbatches,
            inflight=inflight,
            exchanged_rows=None if vision else work.rows(),
            exchanged_width=None if vision else _encoder_width(work),
            recompute=getattr(options, "recompute", "none"),
            lora=work.lora.get(group.module),
            frozen=work.frozen.get(group.module, ()),
            context_parallel=group.context_parallel,
        )
        value = getattr(options, "offload", "none")
        return native_cost(
            lambda q: strategy_cls.estimate(q, options),
            query,
            value in ("optimizer", "all"),
            activations=value in ("activations", "all"),
        )
    # what the group's own options apply: nothing plans memory the run does not save
    mode = getattr(options, "recompute", "none")
    return extended_cost(
        ask,
        shape,
        traits,
        group.degree,
        group.replicas,
        work.seq_len(group.module),
        precision,
        work.samples,
        layout.microbatches,
        opts,
        mode,
        None if vision else work.rows(),
    )


def _encoder_width(work: Workload) -> int | None:
    for s in work.shapes.values():
        if isinstance(s, EncoderShape):
            return s.out_hidden
    return None


#: driver calls a rank serves per microbatch (encode + backward; loss_and_backward +
#: release) and per step (reduce_and_norm, step), besides the transfer hop
CALLS_PER_MICROBATCH = 2
CALLS_PER_STEP = 2


def latency_steps(kind: str, ranks: int) -> int:
    """Message steps of one collective call over ``ranks`` ranks (ring / pairwise /
    binomial-tree algorithms, Thakur et al. 2005): each pays the link's α."""
    if ranks <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (ranks - 1)
    if kind == "broadcast":
        return math.ceil(math.log2(ranks))
    return ranks - 1  # all_gather, reduce_scatter, all_to_all, and any other kind


def collective_seconds(cost: Cost, ranks: int, cluster: Cluster) -> float:
    """α-β time of a group's collectives: latency per call and step, bytes over bandwidth."""
    alpha = cluster.latency(ranks)
    latency = sum(n * latency_steps(k, ranks) * alpha for k, n in cost.comm_calls_by_kind.items())
    return latency + sum(cost.comm_bytes_by_kind.values()) / cluster.bandwidth(ranks)


def layers_of(shape: Shape) -> int:
    """Layers a microbatch passes through: blocks (or decoder layers) plus one for
    the embedding / merger / head."""
    return (shape.depth if isinstance(shape, EncoderShape) else shape.layers) + 1


def overhead_seconds(shape: Shape, microbatches: int, cluster: Cluster, compute_s: float = 0.0) -> float:
    """Fixed cost per step whatever the sizes: layer passes and driver calls. With
    asynchronous launches only the launch time beyond ``compute_s`` (the device's
    work they queue) is on the critical path."""
    launch = microbatches * layers_of(shape) * cluster.layer_overhead
    if cluster.async_launch:
        launch = max(0.0, launch - compute_s)
    return launch + (CALLS_PER_MICROBATCH * microbatches + CALLS_PER_STEP) * cluster.call_latency


def evaluate(
    layout: Layout,
    costs: dict[str, Cost],
    cluster: Cluster,
    work: Workload | None = None,
    groups: dict[str, GroupCost] | None = None,
    memo: dict[tuple[Any, ...], Any] | None = None,
) -> Layout:
    """Fill ``layout``'s time and memory from its groups' ``costs`` on ``cluster``
    (``work``: the module shapes, for the per-layer overhead; without it none is charged;
    ``groups``: each group's allocator view and offload (:func:`group_cost`): on a
    ``cuda_allocator`` cluster the memory is the allocator's, and offload's exposed seconds count;
    ``memo``: each group's times by its cost object, microbatches and link, kept by the search
    across the layouts that share the group — the same numbers, computed once)."""
    step_time(layout, costs, cluster, work, groups, memo)
    return device_fit(layout, costs, cluster, groups, memo)


def step_time(
    layout: Layout,
    costs: dict[str, Cost],
    cluster: Cluster,
    work: Workload | None = None,
    groups: dict[str, GroupCost] | None = None,
    memo: dict[tuple[Any, ...], Any] | None = None,
) -> Layout:
    """:func:`evaluate`'s time half: ``layout``'s costs, per-group times and step time."""
    layout.costs = costs
    total_ranks = sum(g.ranks for g in layout.groups.values())
    spans = total_ranks if layout.placement == "disaggregated" else 1
    across = cluster.bandwidth(spans)
    m = layout.microbatches
    per: dict[str, float] = {}
    for name, g in layout.groups.items():
        c = costs[name]
        key = (name, g, id(c), m, across)
        hit = None if memo is None else memo.get(key)
        if hit is None:
            times = _group_times(name, g, c, m, across, cluster, work, (groups or {}).get(name))
            hit = (times, sum(times.values()))
            if memo is not None:
                memo[key] = hit
        layout.times[name] = dict(hit[0])
        per[name] = hit[1]
    encoders = [per[name] for name in layout.groups if name != "llm"]
    if layout.placement == "disaggregated" and layout.schedule == "encoders_ahead" and encoders:
        stages = [sum(encoders), per["llm"]]
        layout.step_time_s = max(stages) + min(stages) / m
    else:
        layout.step_time_s = sum(per.values())
    return layout


def _group_times(
    name: str,
    g: Group,
    c: Cost,
    m: int,
    across: float,
    cluster: Cluster,
    work: Workload | None,
    got: GroupCost | None,
) -> dict[str, float]:
    """One group's seconds by part in a layout of ``m`` microbatches whose groups talk at ``across``."""
    hop = cluster.call_latency
    compute = compute_seconds(c, cluster)
    times = {
        "compute_s": compute,
        "collective_s": collective_seconds(c, g.ranks, cluster),
        "overhead_s": overhead_seconds(work.shapes[name], m, cluster, compute) if work else 0.0,
        "transfer_s": c.sent_bytes / across + m * hop,
    }
    if work and name in work.encoded:
        times = cached_times(times, work.encoded[name], hop)
    if got is not None and got.offload is not None:
        ranks_per_node = min(cluster.devices_per_node, g.ranks)
        times["offload_s"] = offload_seconds(compute_s=compute, ranks_per_node=ranks_per_node, **got.offload)[
            "exposed_s"
        ]
    if got is not None and got.activation_offload is not None:
        times["activation_offload_s"] = activation_offload_seconds(**got.activation_offload)["exposed_s"]
    return times


def device_fit(
    layout: Layout,
    costs: dict[str, Cost],
    cluster: Cluster,
    groups: dict[str, GroupCost] | None = None,
    memo: dict[tuple[Any, ...], Any] | None = None,
) -> Layout:
    """:func:`evaluate`'s memory half: the worst device's bytes and whether ``layout`` fits
    (``memo``: as :func:`evaluate`'s, each group's named view kept there too)."""
    if groups and cluster.cuda_allocator:
        views = []
        for n in layout.groups:
            key = ("memory", n, id(groups[n].memory))
            view = None if memo is None else memo.get(key)
            if view is None:
                view = replace(groups[n].memory, module=n)
                if memo is not None:
                    memo[key] = view
            views.append(view)
        per_device = (
            [device_memory(views)]
            if layout.placement == "collocated"
            else [device_memory([v]) for v in views]
        )
        worst = max(per_device, key=lambda d: d.total)
        layout.memory_bytes, layout.memory_terms = worst.total, dict(worst.terms)
        layout.host_bytes = worst.host_per_device
    else:
        mems = [c.memory_bytes for c in costs.values()]
        layout.memory_bytes = sum(mems) if layout.placement == "collocated" else max(mems)
        layout.host_bytes = sum(g.memory.host for g in (groups or {}).values())
    layout.fits = layout.memory_bytes <= cluster.memory_budget and host_fits(layout, cluster)
    return layout


def host_fits(layout: Layout, cluster: Cluster) -> bool:
    """The offloaded state of a node's ranks fits its host memory (``Cluster.host_memory``; 0: not
    checked): every device of a node may hold the worst device's host share."""
    if not cluster.host_memory or not layout.host_bytes:
        return True
    return layout.host_bytes * cluster.devices_per_node <= cluster.host_memory
