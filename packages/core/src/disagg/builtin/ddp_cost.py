"""``ddp``'s cost: every rank a whole replica of the module on its own samples,
gradients summed over the group in buckets (the base class's reduction).

Exact (equal to what :class:`disagg.interfaces.CommCounter` and
``Strategy.state_bytes`` count): state bytes, and an encoder's communication.
"""

from __future__ import annotations

from disagg.interfaces import sharded
from disagg.interfaces.chunked_loss import DEFAULT_CHUNK_TOKENS
from disagg.interfaces.cost import Cost, CostQuery, assemble, held_tokens, workload
from disagg.interfaces.cost_rules import (
    extra_flops,
    grad_reduce_calls,
    recompute_mode,
    replica_activation_bytes,
    replicated_comm,
    train_flops,
    transfer_bytes,
)
from disagg.interfaces.gemms import Split, strategy_compute


def estimate(query: CostQuery, chunk: int | None = DEFAULT_CHUNK_TOKENS, shard: str = "none") -> Cost | None:
    """``shard``: ``parallel.<module>.shard`` (:mod:`disagg.interfaces.sharded`): its state term
    is exact; the sharded state's own collectives (ZeRO-1's broadcasts, FSDP2's all-gathers and
    reduce-scatters, :func:`disagg.interfaces.sharded.step_comm`) are the libraries', which the
    collective counter does not see, so with ``shard`` only the state term is marked exact."""
    if shard in sharded.FSDP_MODES and not query.encoder:
        return None  # refused for the LLM at validation (encoders only)
    mode = recompute_mode(query.recompute)
    w = workload(query)
    shape = query.shape
    numels = [t.numel for t in shape.tensors()]
    tokens = held_tokens(query, w)
    act = replica_activation_bytes(shape, mode, tokens, w.act_bytes, chunk)
    shapes = [t.shape for t in shape.tensors()]
    per_mb = -(-w.samples_per_replica // w.microbatches)  # one forward per sample
    units = getattr(shape, "depth", 0) + 1
    comm, calls = sharded.step_comm(
        shapes, shard, w, units, replicated_comm(numels, w), grad_reduce_calls(numels, w.world), per_mb
    )
    work = train_flops(shape, query.seq_len)
    work += extra_flops(shape, query.seq_len, work, mode)
    return assemble(
        w,
        state_bytes=sharded.state_bytes(shapes, shard, w.world),
        activation_bytes=act,
        comm=comm,
        calls=calls,
        flops_per_sample=work,
        share=1,
        sent_bytes=transfer_bytes(w),
        compute=strategy_compute(shape, query.seq_len, Split(), w.act_bytes, mode),
        exact=("state_bytes", "comm_bytes") if query.encoder and shard == "none" else ("state_bytes",),
    )
