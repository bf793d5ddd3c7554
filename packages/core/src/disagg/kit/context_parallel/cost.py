"""What context parallelism costs one rank, from the model's shape: the K/V all-gather's bytes
and calls per layer (forward) and the reduce-scatter of their gradients (backward), as
:mod:`.gather` counts them (ring algorithm: each rank sends its rows to ``n-1`` peers)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from disagg.interfaces.cost import Cost, CostQuery
from disagg.interfaces.precision import RECIPES
from disagg.interfaces.shapes import DecoderShape
from disagg.kit.context_parallel.split import padded_length


@dataclass(frozen=True)
class KVExchange:
    """One microbatch's K/V traffic of one context-parallel rank."""

    #: bytes sent by the forward's all-gathers (the backward reduce-scatters the same)
    forward_bytes: int
    #: collective calls of the forward (two per attention layer: K and V); backward the same
    forward_calls: int


def kv_exchange(
    layers: int, batch: int, padded_tokens: int, kv_heads: int, head_dim: int, n: int, element_bytes: int
) -> KVExchange:
    """``padded_tokens``: the microbatch's sequence padded to a multiple of ``2n``; ``kv_heads``:
    the key/value heads this rank holds (``num_key_value_heads / tp`` under TP)."""
    if n == 1:
        return KVExchange(0, 0)
    local = batch * (padded_tokens // n) * kv_heads * head_dim * element_bytes
    return KVExchange(forward_bytes=layers * 2 * (n - 1) * local, forward_calls=layers * 2)


def activation_fraction(n: int) -> float:
    """Share of the layer activations one rank keeps (its tokens), besides
    :func:`saved_gathered_kv`."""
    return 1.0 / n


def saved_gathered_kv(
    layers: int, batch: int, padded_tokens: int, heads: int, head_dim: int, element_bytes: int
) -> int:
    """Bytes of gathered keys and values autograd keeps per rank without ``recompute: full``:
    the attention saves them for its backward, whole-sequence and repeated to the ``heads``
    query heads this rank holds (:mod:`.attention` repeats them after the gather); under
    ``recompute: full`` only the blocks' inputs are kept and the gather is replayed."""
    return layers * 2 * batch * heads * padded_tokens * head_dim * element_bytes


def with_context_parallel(estimate: Callable[[CostQuery], Cost | None], query: CostQuery) -> Cost | None:
    """A strategy's cost at ``query.context_parallel = N`` from its own estimate without it.

    - FLOPs: ``1/N`` of a whole-sample rank's (the split balances causal attention too);
    - state, gradient reduction and the strategy's per-token collectives: the strategy's own
      estimate on ``N x replicas`` ranks, each with the same samples at ``seq_len / N``
      (CP ranks are more data-parallel ranks for the state and the gradient sum, and hold
      ``1/N`` of the tokens);
    - activations: likewise ``1/N`` of the (padded) tokens, plus the gathered K/V the attention
      saves for backward without ``recompute: full`` (:func:`saved_gathered_kv`);
    - plus the K/V exchange (:func:`kv_exchange`) per microbatch, its forward replayed once
      more under ``recompute: full``; bytes shipped to the encoders: the whole-sample rank's
      (the replica's first rank returns every row's gradient).
    Only the state term keeps the strategy's exactness; ``compute`` is left to the FLOPs."""
    n = query.context_parallel
    base = estimate(replace(query, context_parallel=1))
    if n == 1 or base is None:
        return base
    shape = query.shape
    if not isinstance(shape, DecoderShape):
        return None  # refused at validation: only a decoder splits its sequence
    samples = query.replicas if query.samples is None else query.samples
    padded = padded_length(query.seq_len, n)
    split = estimate(
        replace(
            query,
            context_parallel=1,
            replicas=query.replicas * n,
            samples=samples * n,
            seq_len=padded // n,  # a rank's tokens: the sequence is padded to a multiple of 2N
        )
    )
    if split is None:
        return None
    per_mb = -(-samples // (query.replicas * query.microbatches))
    element = RECIPES[query.precision].activation_bytes
    kv = kv_exchange(
        shape.layers, per_mb, padded, max(1, shape.kv_heads // query.degree), shape.head_dim, n, element
    )
    replays = 2 if query.recompute in ("full", True) else 1
    heads = max(1, shape.heads // query.degree)
    kept = (
        0 if replays == 2 else saved_gathered_kv(shape.layers, per_mb, padded, heads, shape.head_dim, element)
    )
    comm = dict(split.comm_bytes_by_kind)
    calls = dict(split.comm_calls_by_kind)
    comm["cp_all_gather"] = kv.forward_bytes * query.microbatches * replays
    comm["cp_reduce_scatter"] = kv.forward_bytes * query.microbatches
    calls["cp_all_gather"] = kv.forward_calls * query.microbatches * replays
    calls["cp_reduce_scatter"] = kv.forward_calls * query.microbatches
    return Cost(
        state_bytes=split.state_bytes,
        activation_bytes=split.activation_bytes + kept,
        comm_bytes_by_kind=comm,
        sent_bytes=base.sent_bytes,
        flops=base.flops / n,
        exact=tuple(k for k in base.exact if k == "state_bytes"),
        comm_calls_by_kind=calls,
        gathered_bytes=split.gathered_bytes,
        host_bytes=split.host_bytes,  # offload: optimizer moves the CP rank's state as the split's
        buffer_bytes=split.buffer_bytes,  # e.g. ddp's gradient bucket: CP ranks reduce like replicas
    )
