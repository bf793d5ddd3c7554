"""``ddp``'s cost: every rank a whole replica of the module on its own samples,
gradients summed over the group in buckets (the base class's reduction).

Exact (equal to what :class:`disagg.interfaces.CommCounter` and
``Strategy.state_bytes`` count): state bytes, and an encoder's communication.

``buffer_bytes`` (the allocator view's ``buffers`` term, :mod:`disagg.kit.cost.memory`): the flat
gradient bucket the replicas' all-reduce fills (:func:`grad_bucket_bytes`).
"""

from __future__ import annotations

from dataclasses import replace

from disagg.interfaces.compute import Split
from disagg.interfaces.cost import Cost, CostQuery
from disagg.interfaces.strategy import DEFAULT_CHUNK_TOKENS
from disagg.kit import sharding as sharded
from disagg.kit.cost import tiled_mlp
from disagg.kit.cost import training as cost_training
from disagg.kit.cost.assemble import assemble, held_tokens, workload
from disagg.kit.cost.gemms import strategy_compute
from disagg.kit.cost.grad_buckets import grad_bucket_bytes
from disagg.kit.cost.rules import (
    extra_flops,
    grad_reduce_calls,
    recompute_mode,
    replica_activation_bytes,
    replicated_comm,
    train_flops,
    transfer_bytes,
)
from disagg.kit.cost.training import query_trained
from disagg.kit.sharding.cost import decoder_gathered_elements, with_offload


def estimate(
    query: CostQuery,
    chunk: int | None = DEFAULT_CHUNK_TOKENS,
    shard: str = "none",
    offload: bool = False,
    overlap: bool = False,
    tiles: int | str = 1,
) -> Cost | None:
    """``shard``: ``parallel.<module>.shard`` (:mod:`disagg.kit.sharding`): its state term
    is exact; the sharded state's own collectives (ZeRO-1's broadcasts, FSDP2's all-gathers and
    reduce-scatters, :func:`disagg.kit.sharding.step_comm`) are the libraries': the
    collective counter sees FSDP2's (``fsdp.counted_comms``), not ZeRO-1's, and with ``shard``
    only the state term is marked exact. ``offload``: ``offload: optimizer``
    (:func:`disagg.kit.sharding.cost.with_offload`: device and host state). ``overlap``:
    ``overlap_grad_reduce`` (every gradient bucket's buffer held, :func:`grad_bucket_bytes`).
    ``tiles``: ``mlp_tiles`` (:mod:`disagg.kit.cost.tiled_mlp`: the MLPs' intermediates one tile at a
    time, their forward once more)."""
    if query.context_parallel > 1:
        from disagg.kit.context_parallel.cost import with_context_parallel

        return with_context_parallel(lambda q: estimate(q, chunk, shard, overlap=overlap, tiles=tiles), query)
    mode = recompute_mode(query.recompute)
    w = workload(query)
    shape = query.shape
    tr = query_trained(query)
    numels = cost_training.numels(tr)  # only trained tensors are reduced (LoRA: the adapters)
    tokens = held_tokens(query, w)
    act = replica_activation_bytes(shape, mode, tokens, w.act_bytes, chunk, tiles)
    if mode != "full":  # under full recompute a block's adapters save only while it replays
        act += cost_training.adapter_activation_bytes(tr, tokens, w.act_bytes)
    # an encoder: one forward per sample; the LLM: one per microbatch over all its samples (a
    # replica without any runs a placeholder, disagg.kit.lockstep)
    per_mb = -(-w.samples_per_replica // w.microbatches) if query.encoder else 1
    units = getattr(shape, "depth", getattr(shape, "layers", 0)) + 1  # FSDP2: blocks + the root
    comm, calls = sharded.step_comm(
        cost_training.shard_shapes(tr, shard),
        shard,
        w,
        units,
        replicated_comm(numels, w),
        grad_reduce_calls(numels, w.world, w.grad_bytes),
        per_mb,
    )
    work = train_flops(shape, query.seq_len) + cost_training.flops_delta(tr, query.seq_len)
    work += extra_flops(shape, query.seq_len, work, mode) + tiled_mlp.replay_flops(
        shape, query.seq_len, tiles
    )
    base = strategy_compute(shape, query.seq_len, Split(), w.act_bytes, "none")
    compute = cost_training.compute_delta(base, tr, query.seq_len, Split()).with_recompute(mode)
    compute = tiled_mlp.replay_compute(compute, shape, query.seq_len, Split(), tiles)
    cost = assemble(
        w,
        state_bytes=cost_training.replicated_state_bytes(tr, shard, w.world, w),
        activation_bytes=act,
        comm=comm,
        calls=calls,
        flops_per_sample=work,
        share=1,
        sent_bytes=transfer_bytes(w),
        compute=compute,
        exact=("state_bytes", "comm_bytes") if query.encoder and shard == "none" else ("state_bytes",),
    )
    cost = replace(
        cost, buffer_bytes=grad_bucket_bytes(numels, w.grad_bytes, w.world, shard, offload, overlap)
    )
    if shard == "parameters" and not query.encoder and w.world > 1:
        # the LLM's whole units beside its shards (its root, the head, is no small unit)
        gathered = w.weight_bytes * decoder_gathered_elements(shape)
        cost = replace(cost, gathered_bytes=gathered)
    if not offload:
        return cost
    mode = shard if w.world > 1 else "none"
    whole = w.weight_bytes * (sum(t.numel for t in tr.trainable) + sum(t.numel for t in tr.frozen))
    return with_offload(cost, sum(t.numel for t in tr.trainable), len(tr.trainable), mode, w.recipe, whole)
