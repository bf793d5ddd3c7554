"""``disagg plan``: choose each module's strategy, degree, replicas and placement.

Every registered strategy describes its own cost (:meth:`Strategy.estimate`);
the planner searches strategies x degrees x replicas x placement per module on
a :class:`~disagg.plan.cluster.Cluster`, drops what does not fit memory, ranks
the rest by predicted step time (:mod:`disagg.plan.model` states the time
model) and writes the best as the ``parallel`` section ``disagg train`` reads.
"""

from disagg.plan.cluster import PRESETS, Cluster, cluster_from
from disagg.plan.model import Group, Layout, Workload
from disagg.plan.search import PlanResult, plan

__all__ = ["PRESETS", "Cluster", "Group", "Layout", "PlanResult", "Workload", "cluster_from", "plan"]
