"""``ulysses``'s cost: each rank of a degree-``d`` group holds ``1/d`` of every
sample's tokens and all of the tower's parameters; full-attention blocks
exchange heads for tokens with two all-to-alls forward and two backward; window
blocks move nothing; gradients are summed over the group as ``ddp`` sums them.

Exact (equal to what :class:`disagg.interfaces.CommCounter` and
``Strategy.state_bytes`` count): state bytes and communication, byte for byte
and call for call; saved activations of a Qwen2.5-VL tower in fp32.
"""

from __future__ import annotations

from dataclasses import replace

from disagg.interfaces.compute import Split
from disagg.interfaces.cost import Cost, CostQuery, EncoderShape, Workload
from disagg.kit import sharding as sharded
from disagg.kit.cost import tiled_mlp
from disagg.kit.cost import training as cost_training
from disagg.kit.cost.assemble import assemble, held_tokens, workload
from disagg.kit.cost.gemms import strategy_compute
from disagg.kit.cost.grad_buckets import grad_bucket_bytes
from disagg.kit.cost.rules import (
    block_elems,
    extra_flops,
    fp32_internal_bytes,
    grad_reduce_calls,
    recompute_mode,
    replicated_comm,
    tile_peak_bytes,
    train_flops,
    transfer_bytes,
    with_recompute,
)
from disagg.kit.cost.training import query_trained
from disagg.kit.sharding.cost import with_offload


def all_to_all_bytes(shape: EncoderShape, w: Workload) -> int:
    """Per full-attention block, forward: q/k/v of the rank's ``n = sN/d`` tokens
    for the other shards' heads ``(d-1)·n·3·(H/d)·e`` and the attention output of
    the other shards' tokens for its heads ``(sN - n)·(H/d)·e``; backward sends the
    same two exchanges reversed. With an even split (``n = sN/d``, true when each
    replica's tokens per microbatch divide into ``d`` whole attention windows) that
    is ``8·(d-1)·n·(H/d)·e`` per block."""
    d = w.degree
    if d == 1:
        return 0
    n_local = w.tokens_per_replica // d
    return len(shape.full_blocks) * 8 * (d - 1) * n_local * (shape.hidden // d) * w.act_bytes


def activation_bytes(
    shape: EncoderShape, tokens: int, degree: int, act_bytes: int, tiles: int | str = 1
) -> int:
    """Saved bytes on one rank while ``tokens`` tokens of the whole sequence are in
    flight (it holds ``tokens / degree``; it permutes pixels, not an index). ``tiles``:
    ``mlp_tiles``, the MLPs on the rank's own rows (:func:`disagg.kit.cost.rules.tile_peak_bytes`:
    one tile of all its rows in flight, an upper bound where images are encoded one by one)."""
    per_token = (shape.input_elems + shape.depth * block_elems(shape, tiles) + shape.head_act) / degree
    tile = tile_peak_bytes(shape, -(-tokens // degree), act_bytes, tiles)
    return (
        int(tokens * per_token * act_bytes)
        + tile
        + fp32_internal_bytes(shape, tokens / degree, tokens / degree, act_bytes)
    )


def replay(shape: EncoderShape, w: Workload, mode: str) -> tuple[dict[str, int], dict[str, int]]:
    """A ``full`` replay runs the forward's two all-to-alls per full-attention block again."""
    if mode != "full" or w.degree == 1:
        return {}, {}
    full = len(shape.full_blocks)
    n_local = w.tokens_per_replica // w.degree
    return (
        {"all_to_all": full * 4 * (w.degree - 1) * n_local * (shape.hidden // w.degree) * w.act_bytes},
        {"all_to_all": 2 * full * w.microbatches},
    )


def estimate(
    query: CostQuery, shard: str = "none", offload: bool = False, overlap: bool = False, tiles: int | str = 1
) -> Cost | None:
    """Nothing for a decoder: ``ulysses`` shards encoder towers only. ``shard``:
    ``parallel.<module>.shard`` (:mod:`disagg.kit.sharding`), exact in the state term;
    the sharded state's own collectives (:func:`disagg.kit.sharding.step_comm`) are the
    libraries' (not counted at run time), so then only the state is marked exact. ``offload``:
    ``offload: optimizer`` (:func:`disagg.kit.sharding.cost.with_offload`). The gradient
    reduction's flat bucket is ``ddp``'s (the base class's reduction:
    :func:`disagg.kit.cost.grad_buckets.grad_bucket_bytes`, ``overlap``: ``overlap_grad_reduce``).
    ``tiles``: ``mlp_tiles`` (:mod:`disagg.kit.cost.tiled_mlp`)."""
    shape = query.shape
    if not isinstance(shape, EncoderShape):
        return None
    mode = recompute_mode(query.recompute)
    w = workload(query)
    d = w.degree
    tr = query_trained(query)
    numels = cost_training.numels(tr)  # only trained tensors are reduced (LoRA: the adapters)
    comm, calls = sharded.step_comm(
        cost_training.shard_shapes(tr, shard),
        shard,
        w,
        shape.depth + 1,
        replicated_comm(numels, w),
        grad_reduce_calls(numels, w.world, w.grad_bytes),
    )
    a2a = all_to_all_bytes(shape, w)
    if a2a:
        comm["all_to_all"] = a2a
    if d > 1:
        calls["all_to_all"] = 4 * len(shape.full_blocks) * w.microbatches
    tokens = held_tokens(query, w)
    held = -(-tokens // d)
    act = with_recompute(
        shape,
        mode,
        activation_bytes(shape, tokens, d, w.act_bytes, tiles),
        w.act_bytes,
        full_held=held,
        selective_held=held,
        layer_bytes=lambda one: activation_bytes(one, tokens, d, w.act_bytes, tiles),  # type: ignore[arg-type]
    )
    if mode != "full":  # under full recompute a block's adapters save only while it replays
        act += cost_training.adapter_activation_bytes(tr, held, w.act_bytes)
    work = train_flops(shape, query.seq_len) + cost_training.flops_delta(tr, query.seq_len)
    work += extra_flops(shape, query.seq_len, work, mode) + tiled_mlp.replay_flops(
        shape, query.seq_len, tiles
    )
    split = Split(tokens=d)
    base = strategy_compute(shape, query.seq_len, split, w.act_bytes, "none")
    cost = assemble(
        w,
        state_bytes=cost_training.replicated_state_bytes(tr, shard, w.world, w),
        activation_bytes=act,
        comm=comm,
        calls=calls,
        flops_per_sample=work,
        share=d,
        sent_bytes=transfer_bytes(w, split=d),
        # dense layers on 1/d of the tokens at full width, attention on all of them for 1/d of the heads
        compute=tiled_mlp.replay_compute(
            cost_training.compute_delta(base, tr, query.seq_len, split).with_recompute(mode),
            shape,
            query.seq_len,
            split,
            tiles,
        ),
        exact=("state_bytes", "comm_bytes") if shard == "none" else ("state_bytes",),
        replay=replay(shape, w, mode),
    )
    cost = replace(
        cost, buffer_bytes=grad_bucket_bytes(numels, w.grad_bytes, w.world, shard, offload, overlap)
    )
    if not offload:
        return cost
    mode = shard if w.world > 1 else "none"
    whole = w.weight_bytes * (sum(t.numel for t in tr.trainable) + sum(t.numel for t in tr.frozen))
    return with_offload(cost, sum(t.numel for t in tr.trainable), len(tr.trainable), mode, w.recipe, whole)
