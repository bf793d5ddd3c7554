"""The config's own layout, scored by the same cost model as the planner's candidates,
so ``disagg plan CONFIG`` answers "how good is mine?" beside the best layouts."""

from __future__ import annotations

from dataclasses import dataclass

from disagg.config.schema import Config
from disagg.kit import Strategy
from disagg.plan.cluster import Cluster
from disagg.plan.model import Group, Layout, Workload, evaluate, group_cost
from disagg.plan.search import PlanResult

#: option values left out of a group's label when they are the default (as the planner's
#: candidates carry only the keys they vary)
_QUIET = {"recompute": "none"}


@dataclass
class OwnLayout:
    """The config's layout as predicted (``layout``), or why it could not be (``why``)."""

    layout: Layout | None
    why: str = ""

    def rank(self, result: PlanResult) -> int | None:
        """1-based place among the fitting layouts by predicted step time (ties: after)."""
        if self.layout is None or not self.layout.fits:
            return None
        return 1 + sum(1 for x in result.ranked if x.step_time_s < self.layout.step_time_s)


def own_layout(
    cfg: Config, work: Workload, cluster: Cluster, strategies: dict[str, type[Strategy]]
) -> OwnLayout:
    """``cfg.parallel`` (groups, placement) with ``train.microbatches`` and ``train.schedule``,
    evaluated on ``cluster`` for ``work``."""
    if cfg.parallel.auto is not None:
        return OwnLayout(None, "parallel: auto (the planner chooses)")
    groups: dict[str, Group] = {}
    options = {}
    for m in work.shapes:
        g = getattr(cfg.parallel, m)
        cls = strategies.get(g.strategy)
        if cls is None:
            return OwnLayout(None, f"parallel.{m}.strategy {g.strategy!r} is not installed")
        try:
            options[m] = cls.options_model.model_validate(g.strategy_options())
        except Exception as exc:
            return OwnLayout(None, f"parallel.{m}: {exc}")
        extra = {**(g.model_extra or {}), "recompute": g.recompute}
        # the group's own keys the strategies cost (disagg.plan.native), where not the default
        extra.update(
            {
                k: v
                for k, v in (("context_parallel", g.context_parallel), ("offload", g.offload))
                if v not in (1, "none")
            }
        )
        opts = tuple(sorted((k, v) for k, v in extra.items() if _QUIET.get(k) != v))
        groups[m] = Group(m, g.strategy, g.degree, g.replicas, opts)
    if cfg.parallel.placement == "disaggregated" and len(groups) < 2:
        return OwnLayout(None, "disaggregated placement with one module")
    layout = Layout(
        groups=groups,
        placement=cfg.parallel.placement,
        microbatches=cfg.train.microbatches,
        schedule=cfg.train.schedule,
    )
    precision = work.precision or cluster.precision
    # each group's cost with the allocator's view and offload's seconds, as the candidates get them
    got = {}
    for m, g in groups.items():
        cost = group_cost(strategies[g.strategy], g, options[m], work, layout, precision)
        if cost is None:
            return OwnLayout(None, f"strategy {g.strategy!r} reports no cost for module {m!r}")
        got[m] = cost
    ranks = [g.ranks for g in groups.values()]
    need = sum(ranks) if layout.placement == "disaggregated" else max(ranks)
    if need > cluster.devices:
        return OwnLayout(None, f"needs {need} devices, the cluster has {cluster.devices}")
    return OwnLayout(evaluate(layout, {m: c.cost for m, c in got.items()}, cluster, work, got))
