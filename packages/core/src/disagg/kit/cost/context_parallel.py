"""``parallel.<decoder>.context_parallel: N``: the cost of splitting a decoder's sequence over
``N`` ranks that exchange keys and values in attention.

A CP rank holds ``1/N`` of every sample's tokens (a head chunk and a tail chunk, so causal work is
even): for everything outside the attention core it does what a data-parallel replica does on a
sequence of ``T/N`` tokens. The strategy is therefore asked for its cost on ``T/N`` tokens with
``N`` times the replicas (:func:`equivalent_query`), and this module adds what differs:

- **attention**: each rank's ``T/N`` queries see ``T`` keys under the causal mask (load-balanced:
  ``4·(T/N)·T·hd·heads / 2`` FLOPs per layer pass), not ``T/N`` (:func:`attention`);
- **K/V exchange** per layer and sample: forward, an all-gather of every rank's K and V,
  ``(N-1)/N · 2·T·kv·hd·e`` bytes sent per rank (``kv`` the rank's KV heads after tensor
  parallelism), and the same reduce-scattered backward; ``full`` recompute gathers again in its
  replay (:func:`kv_exchange`);
- **the gathered K/V** of the layer in attention, ``2·T·kv·hd·e``, held while it runs (one layer
  under ``full`` recompute, every layer without) (:func:`kv_gathered_bytes`);
- **state**: weights and gradients as the tensor-parallel slice, gradients summed over CP (the
  replicas' reduction the equivalent query already counts), the optimizer's part sharded over all
  ``N x replicas`` non-TP ranks (ZeRO-1) (:func:`state_shards`).
"""

from __future__ import annotations

from dataclasses import replace

from disagg.interfaces.compute import Compute
from disagg.interfaces.shapes import DecoderShape


def local_tokens(seq_len: int, cp: int) -> int:
    """Tokens a CP rank holds of a ``seq_len``-token sample (the last rank's, rounded up)."""
    return -(-seq_len // cp)


def kv_heads_local(shape: DecoderShape, tp: int) -> int:
    """KV heads a TP rank holds (replicated when TP exceeds them, as megatron-core does)."""
    return shape.kv_heads // tp if shape.kv_heads % tp == 0 else 1


def kv_exchange(
    shape: DecoderShape, seq_len: int, cp: int, tp: int, act_bytes: int, samples: int, recompute: str
) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes and calls per rank per step of the K/V exchange over ``samples`` samples."""
    if cp <= 1:
        return {}, {}
    full = 2 * local_tokens(seq_len, cp) * cp * kv_heads_local(shape, tp) * shape.head_dim * act_bytes
    sent = (cp - 1) * full // cp
    passes = samples * shape.layers
    gathers = 2 if recompute == "full" else 1
    return (
        {"all_gather": gathers * passes * sent, "reduce_scatter": passes * sent},
        {"all_gather": gathers * passes, "reduce_scatter": passes},
    )


def kv_gathered_bytes(
    shape: DecoderShape, seq_len: int, cp: int, tp: int, act_bytes: int, recompute: str
) -> int:
    """The gathered K/V a rank holds at the peak: one layer's under ``full`` recompute, every layer's
    (saved for backward) otherwise."""
    if cp <= 1:
        return 0
    one = 2 * local_tokens(seq_len, cp) * cp * kv_heads_local(shape, tp) * shape.head_dim * act_bytes
    return one if recompute == "full" else one * shape.layers


def attention(compute: Compute, cp: int) -> Compute:
    """``compute`` of the equivalent ``T/N``-token query with each causal core's keys widened to the
    whole sequence (``T = N x T/N``)."""
    if cp <= 1:
        return compute
    cores = tuple(replace(a, keys=a.keys * cp) if a.causal else a for a in compute.attention)
    return replace(compute, attention=cores)


def attention_flops_delta(compute: Compute, cp: int) -> float:
    """FLOPs the widened cores add to the equivalent query's count."""
    return attention(compute, cp).flops - compute.flops


def state_shards(cp: int, replicas: int) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) shard counts of a TP x CP rank's slice: weights and gradients
    whole on every CP rank, the optimizer's part over the ``cp x replicas`` non-TP ranks."""
    return 1, 1, cp * replicas
