"""``example_ddp``'s cost, stated by the plugin itself from core's shared primitives
(:mod:`disagg.kit.cost.rules`): what a third-party strategy writes so that
``disagg plan`` ranks it and ``disagg bench --predict`` predicts it.

``example_ddp`` runs the base ``Strategy``'s data parallelism: every rank a whole
replica on its own samples (``degree`` 1), gradients summed over the group in
25 MiB buckets after an agreement all-reduce. It recomputes nothing. Its matmuls are
a whole replica's (``Split()``: no tokens or widths split), so the planner charges
each at the efficiency its shape reaches (:mod:`disagg.kit.cost.gemms`).
"""

from __future__ import annotations

from disagg.interfaces.compute import Split
from disagg.interfaces.cost import Cost, CostQuery
from disagg.kit.cost.assemble import assemble, held_tokens, workload
from disagg.kit.cost.gemms import module_compute
from disagg.kit.cost.rules import (
    activation_bytes,
    grad_reduce_calls,
    replicated_comm,
    state_bytes,
    train_flops,
    transfer_bytes,
)


def estimate(query: CostQuery) -> Cost | None:
    if query.degree != 1:
        return None  # no sharding: the planner does not try degree > 1 (``check`` refuses it too)
    w = workload(query)
    shape = query.shape
    numels = [t.numel for t in shape.tensors()]
    return assemble(
        w,
        state_bytes=state_bytes(shape.tensors()),
        activation_bytes=activation_bytes(shape, held_tokens(query, w), w.act_bytes),
        comm=replicated_comm(numels, w),
        calls=grad_reduce_calls(numels, w.world),
        flops_per_sample=train_flops(shape, query.seq_len),
        share=1,
        sent_bytes=transfer_bytes(w),
        compute=module_compute(shape, query.seq_len, Split(), w.act_bytes),
        exact=("state_bytes",),
    )
