"""The compute a rank does, by shape: what a strategy's cost hook states so that the
planner charges each matmul at the efficiency its shape reaches.

A :class:`Compute` lists a rank's matrix products (:class:`Gemm`: ``m x k`` times
``k x n``, forward and the two backward products, which have the same three
dimensions permuted), its fused attention cores (:class:`AttentionCore`, a
FlashAttention-style kernel: queries, keys and values read once, the scores never
leave the chip) and the bytes its element-wise work moves (norms, residual adds,
rotary embeddings, activations, the loss's softmax). How fast each runs on a
machine is the planner's business (:mod:`disagg.plan.efficiency`); a strategy only
says what its layout leaves a rank to do:

- ``tokens``: ranks that split each sample's tokens for the dense layers
  (sequence parallelism à la Ulysses: every matmul sees ``n / tokens`` rows, full width);
- ``tp``: ranks that split every column / row / vocabulary / key-value weight
  (tensor parallelism: the matmul sees all ``n`` rows and ``1/tp`` of the width; a
  ``replicated`` weight stays whole on every rank);
- attention is split by heads over ``tokens x tp`` ranks either way;
- ``sequence_parallel`` (with ``tp``): the token-wise element-wise work (norms,
  residual adds) is split over the ``tp`` ranks too; without it every TP rank
  repeats it for all ``n`` tokens at full width.

**Element-wise bytes** per token, forward, as elements moved (read + written, at the
compute dtype): each norm ``2H``, each residual add ``3H`` (two blocks of each per
layer: ``10H``, token-wise); the rotary embedding of queries and keys ``2(q + kv)``
(``4H`` in a tower) and the MLP's activation ``(mlp_mid + 1)·I`` (SwiGLU: SiLU reads
and writes ``I``, the product reads ``2I`` and writes ``I``: ``5I``; GELU ``3I``),
both width-wise; a tower's merger its norm (``2H``) and activation (``2·O`` per
output row); a decoder's final norm (``2H``) and the loss over its logits (``3V``:
the log-softmax reads and writes them, the target gather reads them, split by
vocabulary under ``tp``). Biases are added in the GEMMs' epilogues and softmax
runs inside the fused attention, so neither moves extra bytes. Training counts
3 x the forward's work, as the FLOPs do (a backward element-wise op reads its input
and the output gradient and writes the input gradient).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

#: forward + two backward products (training = 3 x forward, as the FLOP count)
TRAIN_PASSES = 3


@dataclass(frozen=True)
class Gemm:
    """``count`` products of an ``m x k`` by a ``k x n`` matrix (per step once assembled)."""

    m: int
    n: int
    k: int
    count: float = 1.0

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


@dataclass(frozen=True)
class AttentionCore:
    """``count`` fused attention passes over ``windows`` independent windows of
    ``queries`` queries and ``keys`` keys, ``heads`` heads of ``head_dim`` on this rank."""

    queries: int
    keys: int
    head_dim: int
    heads: int
    windows: int = 1
    causal: bool = False
    count: float = 1.0

    @property
    def flops(self) -> float:
        """``QK^T`` and ``AV``: ``4·q·k·hd`` per head and window, half of it causal."""
        f = 4.0 * self.queries * self.keys * self.head_dim * self.heads * self.windows * self.count
        return f / 2 if self.causal else f


@dataclass(frozen=True)
class Compute:
    """What one rank computes (per sample while a strategy builds it; per step in a :class:`Cost`)."""

    gemms: tuple[Gemm, ...] = ()
    attention: tuple[AttentionCore, ...] = ()
    #: bytes the element-wise work reads and writes
    elementwise_bytes: float = 0.0
    #: bytes per element of the compute dtype (2 under bf16, 4 in fp32)
    elem_bytes: int = 4

    @property
    def flops(self) -> float:
        return sum(g.flops for g in self.gemms) + sum(a.flops for a in self.attention)

    def scaled(self, factor: float, *, dense: bool = True, elementwise: bool = True) -> Compute:
        """Every count times ``factor`` (``dense``/``elementwise`` False: attention only)."""
        return replace(
            self,
            gemms=tuple(replace(g, count=g.count * factor) for g in self.gemms) if dense else self.gemms,
            attention=tuple(replace(a, count=a.count * factor) for a in self.attention),
            elementwise_bytes=self.elementwise_bytes * (factor if elementwise else 1.0),
        )

    def with_recompute(self, mode: str) -> Compute:
        """A replay's work on top (:func:`disagg.kit.cost.rules.extra_flops`): ``full``
        runs every forward once more (``4/3``), ``selective`` the attention cores."""
        if mode == "full":
            return self.scaled(4 / 3)
        if mode == "selective":
            return self.scaled(4 / 3, dense=False, elementwise=False)
        return self


@dataclass(frozen=True)
class Split:
    """How a layout divides one sample's work over the ranks that share it (module docstring)."""

    tokens: int = 1
    tp: int = 1
    sequence_parallel: bool = False

    @property
    def heads(self) -> int:
        return self.tokens * self.tp
