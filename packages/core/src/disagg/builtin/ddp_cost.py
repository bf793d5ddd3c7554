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
from disagg.kit.cost import training as cost_training
from disagg.kit.cost.assemble import assemble, held_tokens, workload
from disagg.kit.cost.gemms import strategy_compute
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
from disagg.kit.grads.buckets import bucket_sizes
from disagg.kit.sharding.cost import decoder_gathered_elements, with_offload
from disagg.kit.sharding.modes import FSDP_MODES


def grad_bucket_bytes(
    numels: list[int], grad_bytes: int, world: int, shard: str, offload: bool, overlap: bool = False
) -> int:
    """Device bytes of the flat buffers the group's gradient all-reduce allocates
    (:func:`disagg.kit.grads.all_reduce_bucketed`): a bucket of several gradients (at most
    ``BUCKET_BYTES``, 25 MiB, or all of them if fewer) is concatenated into one tensor, one bucket
    at a time; a bucket of one contiguous gradient is reduced in place. ``overlap``
    (``overlap_grad_reduce``, :class:`disagg.kit.grads.overlap.OverlappedReducer`): every
    bucket's buffer is held until the reduction ends, a copy of all the gradients. None on one
    rank, under FSDP2 (``shard: gradients | parameters`` reduce-scatter in backward) or
    ``offload: optimizer`` (the reduction runs on the host masters' gradient sums). Counted as
    held beside the activations: whether it is live at their peak is timing
    (``tests/test_allocator_peak.py`` measured ``ddp``'s llm peak at 0.85 and 1.22 of the
    prediction without it, the two peaks apart by exactly the gradients' bytes)."""
    if world == 1 or shard in FSDP_MODES or offload:
        return 0
    buckets = bucket_sizes(numels, grad_bytes)
    sizes = [sum(numels[i] for i in b) * grad_bytes for b in buckets]
    if overlap:
        return sum(sizes)
    return max((n for n, b in zip(sizes, buckets) if len(b) > 1), default=0)


def estimate(
    query: CostQuery,
    chunk: int | None = DEFAULT_CHUNK_TOKENS,
    shard: str = "none",
    offload: bool = False,
    overlap: bool = False,
) -> Cost | None:
    """``shard``: ``parallel.<module>.shard`` (:mod:`disagg.kit.sharding`): its state term
    is exact; the sharded state's own collectives (ZeRO-1's broadcasts, FSDP2's all-gathers and
    reduce-scatters, :func:`disagg.kit.sharding.step_comm`) are the libraries': the
    collective counter sees FSDP2's (``fsdp.counted_comms``), not ZeRO-1's, and with ``shard``
    only the state term is marked exact. ``offload``: ``offload: optimizer``
    (:func:`disagg.kit.sharding.cost.with_offload`: device and host state). ``overlap``:
    ``overlap_grad_reduce`` (every gradient bucket's buffer held, :func:`grad_bucket_bytes`)."""
    if query.context_parallel > 1:
        from disagg.kit.context_parallel.cost import with_context_parallel

        return with_context_parallel(lambda q: estimate(q, chunk, shard, overlap=overlap), query)
    mode = recompute_mode(query.recompute)
    w = workload(query)
    shape = query.shape
    tr = query_trained(query)
    numels = cost_training.numels(tr)  # only trained tensors are reduced (LoRA: the adapters)
    tokens = held_tokens(query, w)
    act = replica_activation_bytes(shape, mode, tokens, w.act_bytes, chunk)
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
    work += extra_flops(shape, query.seq_len, work, mode)
    base = strategy_compute(shape, query.seq_len, Split(), w.act_bytes, "none")
    compute = cost_training.compute_delta(base, tr, query.seq_len, Split()).with_recompute(mode)
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
