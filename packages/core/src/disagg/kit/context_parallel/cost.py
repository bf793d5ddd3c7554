"""What context parallelism costs one rank, from the model's shape: the K/V all-gather's bytes
and calls per layer (forward) and the reduce-scatter of their gradients (backward), as
:mod:`.gather` counts them (ring algorithm: each rank sends its rows to ``n-1`` peers)."""

from __future__ import annotations

from dataclasses import dataclass


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
    """Share of the layer activations one rank keeps (its tokens); the gathered K/V of the
    layer being computed are transient (under ``recompute: full`` they are never saved)."""
    return 1.0 / n
