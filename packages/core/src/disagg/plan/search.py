"""Search strategies x degrees x replicas x placement for every module; rank by predicted step time."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from disagg.interfaces import Cost, Family, StrategyOptions
from disagg.kit import Strategy
from disagg.plan.cluster import Cluster
from disagg.plan.dominance import Twins, ahead, rank_key
from disagg.plan.extended import GroupCost
from disagg.plan.model import (
    Group,
    Layout,
    Workload,
    device_fit,
    evaluate,
    group_cost,
    module_cost,
    step_time,
)

PLACEMENTS = ("collocated", "disaggregated")
#: the ``mlp_tiles`` value the fallback pass offers (:mod:`disagg.kit.recompute.tiled_mlp`'s ``auto``)
AUTO_TILES = "auto"


@dataclass
class PlanResult:
    cluster: Cluster
    workload: Workload
    #: layouts that fit memory, fastest first
    ranked: list[Layout]
    #: layouts predicted out of memory, fastest first
    oom: list[Layout]
    #: strategy -> why the planner left it out (it reports no cost)
    skipped: dict[str, str] = field(default_factory=dict)
    #: module -> strategies that report nothing for that module (not applicable)
    not_for: dict[str, list[str]] = field(default_factory=dict)
    #: the tiles pass ran: nothing fit without ``mlp_tiles`` (:func:`plan`'s ``tiles``), so the
    #: lists hold the layouts of the search with ``mlp_tiles: auto`` offered
    tiled: bool = False

    @property
    def best(self) -> Layout:
        if not self.ranked:
            raise ValueError(
                f"no layout fits {self.cluster.memory_budget / 2**30:.1f} GiB per device "
                f"({len(self.oom)} tried; the smallest needs "
                f"{min((x.memory_bytes for x in self.oom), default=0) / 2**30:.1f} GiB)"
            )
        return self.ranked[0]

    def find(self, **modules: str) -> list[Layout]:
        """Layouts (fitting first, then OOM) whose modules use these strategies
        (``find(vision=NAME)``)."""
        return [
            x for x in self.ranked + self.oom if all(x.groups[m].strategy == s for m, s in modules.items())
        ]


def plan(
    work: Workload,
    cluster: Cluster,
    strategies: dict[str, type[Strategy]],
    families: dict[str, Family] | None = None,
    placements: tuple[str, ...] = PLACEMENTS,
    prune: bool = False,
    tiles: bool = False,
) -> PlanResult:
    """Every valid layout of ``work``'s modules on ``cluster``, evaluated and ranked.

    ``families``: module -> family instance, when the model dir is at hand; the
    strategies' and families' own ``check`` then rule out meshes they cannot run
    (without it, a degree must divide the module's attention heads).

    ``prune``: leave out the layouts that a less-offloaded twin beats (:mod:`disagg.plan.dominance`:
    the same best, the same order of what is kept); ``disagg plan`` and ``parallel: auto`` do, the
    analyses that look layouts up by name (the published setting's) do not.

    ``tiles``: when no layout fits, search again with ``mlp_tiles: auto`` offered beside every
    variant of the strategies that run it (:func:`_variants`), and return that search (a fallback
    pass: ``mlp_tiles`` only saves memory and adds the MLPs' recompute, so it is looked for only
    where memory is what fails; a plan that fits without it is the same plan, searched once).
    ``disagg plan`` and ``parallel: auto`` do; with ``prune``, a tiled layout whose untiled twin
    fits and ranks ahead is left out, like offload's (:mod:`disagg.plan.dominance`).

    Two stages: :func:`candidates` (each module's groups a strategy can run) and
    :func:`evaluate_layouts` (every combination of them, placed, costed)."""
    result = _search(work, cluster, strategies, families, placements, prune, tiles=False)
    if tiles and not result.ranked:
        result = _search(work, cluster, strategies, families, placements, prune, tiles=True)
    return result


def _search(
    work: Workload,
    cluster: Cluster,
    strategies: dict[str, type[Strategy]],
    families: dict[str, Family] | None,
    placements: tuple[str, ...],
    prune: bool,
    tiles: bool,
) -> PlanResult:
    """One pass of :func:`plan` (``tiles``: with ``mlp_tiles: auto`` offered)."""
    found = candidates(work, cluster, strategies, families, tiles=tiles)
    layouts = evaluate_layouts(found.per_module, work, cluster, strategies, placements, prune)
    layouts.sort(key=rank_key)
    return PlanResult(
        cluster=cluster,
        workload=work,
        ranked=[x for x in layouts if x.fits],
        oom=[x for x in layouts if not x.fits],
        skipped=found.skipped,
        not_for={m: v for m, v in found.not_for.items() if v},
        tiled=tiles,
    )


# -- stage 1: candidate groups per module ---------------------------------------------------------
@dataclass
class Candidates:
    """Each module's runnable groups (with their options), and the strategies left out."""

    #: module -> (group, its options), in strategy, variant, mesh order
    per_module: dict[str, list[tuple[Group, StrategyOptions]]]
    #: strategy -> why it was left out everywhere (it reports no cost)
    skipped: dict[str, str]
    #: module -> strategies that report nothing for that module
    not_for: dict[str, list[str]]


def candidates(
    work: Workload,
    cluster: Cluster,
    strategies: dict[str, type[Strategy]],
    families: dict[str, Family] | None = None,
    tiles: bool = False,
) -> Candidates:
    """Every (strategy, option variant, mesh) each module could run as a group; raises
    :class:`ValueError` for a module no strategy can plan. ``tiles``: each variant also with
    ``mlp_tiles: auto`` where the strategy and the module's family run it (:func:`_variants`)."""
    modules = list(work.shapes)
    per_module: dict[str, list[tuple[Group, StrategyOptions]]] = {m: [] for m in modules}
    reports: dict[str, bool] = {}
    not_for: dict[str, list[str]] = {m: [] for m in modules}
    # a family's check reads its model dir's config each time: once per (module, strategy, mesh)
    checked: dict[tuple[Any, ...], list[str]] = {}
    for name, cls in sorted(strategies.items()):
        for m in modules:
            family = (families or {}).get(m)
            groups, found = _module_groups(name, cls, m, work, cluster, family, checked, tiles)
            per_module[m] += groups
            reports[name] = reports.get(name, False) or found
            if not found:
                not_for[m].append(name)
    skipped = {
        n: "reports no cost (Strategy.estimate returns None)" for n, found in reports.items() if not found
    }
    not_for = {m: [n for n in names if n not in skipped] for m, names in not_for.items()}
    for m in modules:
        if not per_module[m]:
            raise ValueError(f"no strategy can plan module {m!r} (skipped: {', '.join(skipped) or 'none'})")
    return Candidates(per_module, skipped, not_for)


def _module_groups(
    name: str,
    cls: type[Strategy],
    module: str,
    work: Workload,
    cluster: Cluster,
    family: Family | None,
    checked: dict[tuple[Any, ...], list[str]],
    tiles: bool = False,
) -> tuple[list[tuple[Group, StrategyOptions]], bool]:
    """Strategy ``name``'s valid groups for ``module``, and whether it reports a cost for it at all."""
    out: list[tuple[Group, StrategyOptions]] = []
    found = False
    tiles = tiles and _tiles_fit(cls, module, family)
    for variant in _variants(cls, cls.option_variants(), work.recompute, tiles):
        if _offloads(variant) and not (work.strategy_keys and cluster.cuda_allocator):
            continue  # host memory beside a GPU: offered on GPU clusters, for a config's plan
        try:
            options = cls.options_model(**variant)
        except Exception:  # a third party's options may not accept our variant
            continue
        recipe = work.precision or cluster.precision
        if work.strategy_keys and precision_refusal(cls, options, recipe, module):
            continue
        extras = layout_variants(name, module, variant, work, cluster)
        if work.strategy_keys:
            extras = extras + strategy_cp(name, cls, module, variant, work, cluster, family)
        for extra in extras:
            g_opts = tuple(sorted({**variant, **extra}.items()))
            cp = int(extra.get("context_parallel", 1))
            # FSDP + CP is costed where the strategy alone states no FSDP for a decoder: probe each
            if _probe(cls, Group(module, name, 1, 1, g_opts), options, work, cluster) is None:
                continue
            found = True
            for d, r in _meshes(cluster.devices // cp, work.samples):
                group = Group(module, name, d, r, g_opts)
                if _valid(cls, group, options, work, family, checked):
                    out.append((group, options))
    return out, found


def layout_variants(
    strategy: str, module: str, variant: dict[str, Any], work: Workload, cluster: Cluster
) -> list[dict[str, Any]]:
    """The planner's own layout keys on top of a strategy's variant (:mod:`disagg.plan.extended`),
    for the strategies ``work.modelled`` states traits for: ``context_parallel`` 2, 4, ... for a
    decoder (TP x CP, or FSDP + CP where the variant shards the parameters), and ``offload:
    optimizer`` where the cluster is GPUs (host memory beside them); both for full training only
    (no LoRA, nothing frozen). A plan of a config (``disagg plan``, ``parallel: auto``) models none:
    it asks the strategies' own hooks instead (:func:`strategy_cp`, the strategies' ``offload``
    option variants, :mod:`disagg.plan.native`), so it never writes a layout ``disagg train`` refuses."""
    from disagg.interfaces.shapes import DecoderShape

    out: list[dict[str, Any]] = [{}]
    traits = work.modelled.get(strategy)
    if traits is None or work.lora.get(module) or work.frozen.get(module):
        return out
    cp_ok = isinstance(work.shapes[module], DecoderShape) and traits.context_parallel is not None
    if traits.context_parallel == "fsdp":
        cp_ok = cp_ok and traits.shard_mode(variant) == "parameters"
    if cp_ok:
        c = 2
        while c <= cluster.devices:
            if cluster.devices % c == 0:
                out.append({"context_parallel": c})
            c *= 2
    if cluster.cuda_allocator and traits.offload:
        # on top of a variant's own activation offload, the optimizer's makes ``all``
        both = "all" if variant.get("offload") in ("activations", "all") else "optimizer"
        out += [{**x, "offload": both} for x in list(out)]
    return out


def _tiles_fit(cls: type[Strategy], module: str, family: Family | None) -> bool:
    """Whether validation accepts ``mlp_tiles`` for ``module`` under strategy ``cls``
    (:func:`disagg.config.model_checks.resolve_module`): the strategy states ``mlp_tiles_support``
    and, with a family at hand, the family declares its MLP modules."""
    from disagg.kit.recompute import tiled_mlp

    if not getattr(cls, "mlp_tiles_support", False):
        return False
    return family is None or not tiled_mlp.family_problems(family, "", "")


def _offloads(variant: dict[str, Any]) -> bool:
    return variant.get("offload", "none") != "none" or bool(variant.get("offload_optimizer"))


def precision_refusal(cls: type[Strategy], options: StrategyOptions, recipe: str, module: str) -> str:
    """The first problem the strategy's own precision checks find with these options under
    ``recipe`` (as validation would: e.g. an offloaded optimizer a backend holds only in ``fp32``);
    '' when none does. The planner and ``disagg bench``'s published fit table both ask it."""
    try:
        problems = cls.precision_problems(recipe, options, f"parallel.{module}")
    except Exception:  # a third party's check that needs more: validation will say
        return ""
    return str(problems[0]) if problems else ""


def strategy_cp(
    name: str,
    cls: type[Strategy],
    module: str,
    variant: dict[str, Any],
    work: Workload,
    cluster: Cluster,
    family: Family | None,
) -> list[dict[str, Any]]:
    """``context_parallel`` 2, 4, ... (dividing the devices) for the LLM under a strategy and a
    family that state ``context_parallel_support``, costed by the strategy's own hook
    (:attr:`CostQuery.context_parallel`); not with options validation refuses beside CP
    (:func:`disagg.config.model_checks.context_parallel_option_problems`), nor for a strategy the
    published setting models by traits (:func:`layout_variants`)."""
    from disagg.interfaces.shapes import DecoderShape

    if module != "llm" or name in work.modelled or not isinstance(work.shapes[module], DecoderShape):
        return []
    if not getattr(cls, "context_parallel_support", False):
        return []
    from disagg.config.model_checks import context_parallel_option_problems

    try:
        options = cls.options_model(**variant)
    except Exception:  # a third party's options may not accept our variant
        return []
    if context_parallel_option_problems(2, options):
        return []
    if family is not None and not getattr(type(family), "context_parallel_support", False):
        return []
    out, c = [], 2
    while c <= cluster.devices:
        if cluster.devices % c == 0:
            out.append({"context_parallel": c})
        c *= 2
    return out


# -- stage 2: layouts from the candidates, placed and costed ----------------------------------------
def evaluate_layouts(
    per_module: dict[str, list[tuple[Group, StrategyOptions]]],
    work: Workload,
    cluster: Cluster,
    strategies: dict[str, type[Strategy]],
    placements: tuple[str, ...] = PLACEMENTS,
    prune: bool = False,
) -> list[Layout]:
    """Every combination of one candidate per module, in each placement it fits,
    evaluated (unsorted); combinations a strategy reports no cost for are left out, and with
    ``prune`` those a less-offloaded twin beats (:mod:`disagg.plan.dominance`)."""
    modules = list(per_module)
    encoders = [m for m in modules if m != "llm"]
    cache: dict[tuple[Any, ...], GroupCost | None] = {}
    memo: dict[tuple[Any, ...], Any] = {}  # each group's times (and memory view), shared by its layouts
    out: list[Layout] = []
    twins = Twins(per_module) if prune else None
    ordered = twins.per_module if twins else per_module
    for idx in itertools.product(*(range(len(ordered[m])) for m in modules)):
        combo = tuple(ordered[m][i] for m, i in zip(modules, idx))
        groups = {g.module: g for g, _ in combo}
        lead = groups[encoders[0]] if encoders else groups["llm"]
        micro = work.samples // lead.replicas
        if not _lockstep_fits(groups, strategies, work.samples // micro):
            continue
        for placement in placements:
            if not _placement_fits(placement, groups, cluster.devices):
                continue
            schedule = (
                "encoders_ahead" if placement == "disaggregated" and micro > 1 and encoders else "sequential"
            )
            layout = Layout(groups=groups, placement=placement, microbatches=micro, schedule=schedule)
            got = _costs(combo, layout, work, cluster, strategies, cache)
            if got is None:
                continue
            costs = {m: c.cost for m, c in got.items()}
            if twins is None:
                out.append(evaluate(layout, costs, cluster, work, got, memo))
                continue
            rival = twins.rival(idx, placement)
            step_time(layout, costs, cluster, work, got, memo)
            # slower than a lesser twin that fits: dominated whatever its memory (not counted)
            if rival is not None and round(layout.step_time_s, 12) > round(rival.step_time_s, 12):
                twins.record(idx, placement, rival)
                continue
            device_fit(layout, costs, cluster, got, memo)
            if rival is not None and ahead(rival, layout):
                twins.record(idx, placement, rival)
                continue
            out.append(layout)
            twins.record(idx, placement, layout if layout.fits else rival)
    return out


def _lockstep_fits(groups: dict[str, Group], strategies: dict[str, type[Strategy]], per_mb: int) -> bool:
    """A lockstep group needs a sample for every replica in every microbatch."""
    return not any(strategies[g.strategy].lockstep and per_mb < g.replicas for g in groups.values())


def _placement_fits(placement: str, groups: dict[str, Group], devices: int) -> bool:
    """Collocated groups share the devices (the largest must fit); disaggregated ones
    each take their own (all must fit, and there must be two groups to separate)."""
    ranks = [g.ranks for g in groups.values()]
    if placement == "collocated":
        return max(ranks) <= devices
    return not (placement == "disaggregated" and (sum(ranks) > devices or len(groups) < 2))


def _costs(
    combo: tuple[tuple[Group, StrategyOptions], ...],
    layout: Layout,
    work: Workload,
    cluster: Cluster,
    strategies: dict[str, type[Strategy]],
    cache: dict[tuple[Any, ...], GroupCost | None],
) -> dict[str, GroupCost] | None:
    """Each group's cost in ``layout`` (cached by group, microbatches and whether its
    activations wait in flight); None when a strategy reports none."""
    costs: dict[str, GroupCost] = {}
    for g, options in combo:
        inflight = layout.schedule == "encoders_ahead" and g.module != "llm"
        key = (g, layout.microbatches, inflight)
        if key not in cache:
            cache[key] = group_cost(
                strategies[g.strategy], g, options, work, layout, work.precision or cluster.precision
            )
        got = cache[key]
        if got is None:
            return None
        costs[g.module] = got
    return costs


def _variants(
    cls: type[Strategy], variants: list[dict[str, Any]], only_recompute: bool, tiles: bool = False
) -> list[dict[str, Any]]:
    """Each option variant once per ``recompute`` mode the strategy applies (like any
    other layout key; ``none`` is left implicit). With ``only_recompute`` (``--recompute``)
    ``none`` is left out where the strategy offers another mode. ``tiles``: each of them
    also with ``mlp_tiles: auto`` (ALST's tile of about ``hidden`` rows; :func:`plan`'s
    fallback pass, for a strategy :func:`_tiles_fit` accepts)."""
    modes = list(getattr(cls, "recompute_modes", ("none",)))
    if only_recompute and len(modes) > 1:
        modes = [m for m in modes if m != "none"]
    out = [{**v, **({"recompute": m} if m != "none" else {})} for v in variants for m in modes]
    # ``offload: activations`` (``all`` with the optimizer's) where recompute is full: host memory
    # beside a GPU, so offered on GPU clusters only, like the optimizer's (:func:`_offloads`)
    more = {"none": "activations", "optimizer": "all"}
    out += [
        {**v, "offload": more[v.get("offload", "none")]}
        for v in out
        if v.get("recompute") == "full" and v.get("offload", "none") in more
    ]
    if tiles:
        out += [{**v, "mlp_tiles": AUTO_TILES} for v in out]
    return out


def _meshes(devices: int, samples: int) -> list[tuple[int, int]]:
    """(degree, replicas) with at most ``devices`` ranks; replicas divide the batch
    (each replica gets the same number of samples per microbatch)."""
    out = []
    for d in range(1, devices + 1):
        for r in range(1, devices // d + 1):
            if samples % r == 0 and devices % (d * r) == 0:
                out.append((d, r))
    return out


def _probe(
    cls: type[Strategy], group: Group, options: StrategyOptions, work: Workload, cluster: Cluster
) -> Cost | None:
    layout = Layout(
        groups={group.module: group}, placement="collocated", microbatches=1, schedule="sequential"
    )
    return module_cost(cls, group, options, work, layout, work.precision or cluster.precision)


def _valid(
    cls: type[Strategy],
    group: Group,
    options: StrategyOptions,
    work: Workload,
    family: Family | None,
    checked: dict[tuple[Any, ...], list[str]] | None = None,
) -> bool:
    """The strategy's (and family's) own checks when a family is at hand; else a degree must
    divide the module's heads (how sequence- and tensor-parallel strategies split attention).
    ``checked``: the family's answers so far, by (module, strategy, degree, replicas)."""
    try:
        problems = cls.check(family, group.degree, group.replicas, options)  # type: ignore[arg-type]
        if family is not None:
            key = (group.module, group.strategy, group.degree, group.replicas)
            cache = {} if checked is None else checked
            if key not in cache:
                cache[key] = family.check(group.strategy, group.degree, group.replicas)
            problems = problems + cache[key]
    except Exception:  # checks that need the family's model dir: fall back to the shape's rule
        if family is not None:
            return False
        problems = []
    if problems:
        return False
    if family is None and group.degree > 1:
        return work.shapes[group.module].heads % group.degree == 0
    return True
