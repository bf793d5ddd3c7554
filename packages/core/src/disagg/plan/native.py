"""A group's cost with ``context_parallel`` and ``offload: optimizer`` as its strategy's own hook
states them (:attr:`disagg.interfaces.CostQuery.context_parallel`, the options' ``offload``), and
its device memory as the allocator holds it (:mod:`disagg.kit.cost.memory`).

What the planner adds on top of the strategy's answer is time and the allocator's view, never
state or bytes:

- compute by shape under CP: a strategy's CP estimate states FLOPs only
  (:func:`disagg.kit.context_parallel.cost.with_context_parallel`), which the time model would
  charge at the efficiency curve's ceiling, unlike every other candidate. The shapes come from the
  same strategy's equivalent data-parallel query (``T/N`` tokens, ``N`` times the replicas and
  samples: what a CP rank's matmuls are), each causal attention core's keys widened to the whole
  sequence (:func:`disagg.kit.cost.context_parallel.attention`);
- the host AdamW's seconds of an offloaded optimizer (:func:`disagg.kit.cost.offload.offload_seconds`),
  for the elements whose state the strategy says moved to the host (``Cost.host_bytes`` over the
  recipe's host bytes per element);
- ``offload: activations | all``: core's hooks (:mod:`disagg.kit.recompute.offload`) move the
  blocks' kept inputs whatever the strategy, so the split of its saved bytes between device and
  host is core's rule on the strategy's own counts (:mod:`disagg.kit.cost.activation_offload`), and
  the copies' seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from disagg.interfaces import Cost, CostQuery
from disagg.kit.cost import activation_offload as act_off
from disagg.kit.cost import context_parallel as cpm
from disagg.kit.cost.memory import GroupMemory, communicators
from disagg.kit.cost.offload import host_bytes_per_element
from disagg.kit.cost.rules import one_block
from disagg.plan.extended import GroupCost


def native_cost(
    estimate: Callable[[CostQuery], Cost | None], query: CostQuery, offload: bool, activations: bool = False
) -> GroupCost | None:
    """``estimate``: the strategy's hook with the group's options bound (``offload`` among them);
    ``query``: the group's query, ``context_parallel`` included; ``activations``: the options
    offload the recomputed blocks' inputs."""
    cost = estimate(query)
    if cost is None:
        return None
    optimizer_host = cost.host_bytes
    act_info: dict[str, Any] | None = None
    if activations and query.recompute in ("full", True):
        one_full = estimate(replace(query, shape=one_block(query.shape)))
        if one_full is not None:
            moved = act_off.split(query.shape, cost.activation_bytes, one_full.activation_bytes)
            if not moved.host:  # one block (or none counted): nothing would stay away; not offered
                return None
            cost = replace(cost, activation_bytes=moved.device, host_bytes=cost.host_bytes + moved.host)
            act_info = {"host_bytes": moved.host, "microbatches": query.microbatches}
    cp = query.context_parallel
    if cp > 1 and cost.compute is None:
        split = estimate(_split(query))
        if split is not None and split.compute is not None:
            cost = replace(cost, compute=cpm.attention(split.compute, cp))
    # the backward transient: one block's saves, as the strategy counts them for this rank
    one = estimate(replace(query, shape=one_block(query.shape), recompute="none"))
    alltoall = query.degree - 1 if cost.comm_bytes_by_kind.get("all_to_all") else 0
    memory = GroupMemory(
        module="",
        state=cost.state_bytes,
        gathered=cost.gathered_bytes,
        saved=cost.activation_bytes,
        transient=one.activation_bytes if one is not None else 0,
        communicators=communicators(query.degree, cp, query.replicas),
        alltoall_peers=alltoall,
        buffers=cost.buffer_bytes,
        host=cost.host_bytes,
    )
    info: dict[str, Any] | None = None
    if offload and optimizer_host:
        info = {
            "elements": optimizer_host // host_bytes_per_element(query.precision),
            "precision": query.precision,
            "microbatches": query.microbatches,
        }
    return GroupCost(cost, memory, info, act_info)


def _split(query: CostQuery) -> CostQuery:
    """The data-parallel query whose ranks compute what a CP rank does."""
    n = query.context_parallel
    samples = query.replicas if query.samples is None else query.samples
    return replace(
        query,
        context_parallel=1,
        replicas=query.replicas * n,
        samples=samples * n,
        seq_len=cpm.local_tokens(query.seq_len, n),
    )
