"""How tensor parallelism cuts each parameter, and what a parallelization did: the
:class:`ShardSpec` every parallel parameter carries (``param.tp_spec``), the slicing of full
Hugging Face tensors into a rank's piece and back, and :class:`TPPlan`.

Free of megatron-core on purpose: the strategy class, the families (``qwen3_5``'s gated-delta-net
split), the checkpoint's full form and the sliced load need only these, so building the plugin
registry (every ``disagg`` command, every driver) and a process that runs another strategy do
not import megatron-core (about 2.5 s of CPU); :mod:`disagg_llm_tp.layers` and
:mod:`disagg_llm_tp.parallelize`, which do, are imported where a module is parallelized."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

Kind = Literal["column", "row", "vocab", "kv_replicated", "replicated"]


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter's full tensor maps to this rank's local tensor.

    column: dim 0 cut in ``degree`` contiguous pieces inside each of ``chunks``
        equal blocks (``chunks=3`` for a fused qkv projection), or inside each of
        the blocks of full sizes ``blocks`` when they differ (a gated-delta-net's
        fused q/k/v: key, key and value widths; :mod:`disagg_llm_tp.gdn`).
    vocab: dim 0 padded to a multiple of the degree, then cut; ``full_rows``
        is the unpadded size.
    row: dim 1 cut in ``degree`` pieces.
    kv_replicated: one key/value head (``head``) whose copies live on the
        ``kv_share`` consecutive TP ranks that use it; ``num_heads`` heads in all.
    replicated: identical full copy on every TP rank.

    ``sp_partial``: a replicated parameter used on this rank's tokens only
    (sequence parallelism) or on its heads only (per-head norms), so each TP
    rank holds part of its gradient.
    """

    kind: Kind
    chunks: int = 1
    blocks: tuple[int, ...] = ()
    full_rows: int = 0
    head: int = 0
    kv_share: int = 1
    num_heads: int = 0
    sp_partial: bool = False


@dataclass
class TPPlan:
    """What parallelization did, for the strategy's loss, reductions and checks."""

    #: unpadded vocabulary of the output layer (None: no output layer, e.g. an encoder)
    output_vocab: int | None = None
    #: (start, end) of this rank's slice of the padded output vocabulary
    output_range: tuple[int, int] = (0, 0)
    #: number of key/value heads replicated across ranks and how many ranks share each
    kv_replication: tuple[int, int] | None = None
    swapped: list[str] = field(default_factory=list)
    #: full ``(in_features, out_features)`` of every linear replaced by a parallel one (LoRA's
    #: adapters are drawn for the full shapes, then cut like the base: ``lora.py``)
    linears: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: names of the row linears inside a sequence-parallel region (they reduce-scatter)
    sp_rows: set[str] = field(default_factory=set)


# -- slicing full HF tensors into this rank's piece ---------------------------------------------------
def local_slice(full: torch.Tensor, spec: ShardSpec, shard: int, degree: int) -> torch.Tensor:
    """This rank's piece of a full tensor (the inverse of :func:`merge`)."""
    if spec.kind == "replicated":
        return full
    if spec.kind == "row":
        k = full.shape[1] // degree
        return full[:, shard * k : (shard + 1) * k]
    if spec.kind == "kv_replicated":
        rows = full.shape[0] // spec.num_heads
        return full[spec.head * rows : (spec.head + 1) * rows]
    if spec.kind == "vocab":
        padded = _pad_rows(full, degree)
        m = padded.shape[0] // degree
        return padded[shard * m : (shard + 1) * m]
    blocks = full.split(list(spec.blocks)) if spec.blocks else full.chunk(spec.chunks, dim=0)
    cut = [(b.shape[0] // degree, b) for b in blocks]
    return torch.cat([b[shard * m : (shard + 1) * m] for m, b in cut], dim=0)


def merge(pieces: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Full tensor from the pieces of every TP rank of one replica, in shard order."""
    if spec.kind == "replicated":
        return pieces[0]
    if spec.kind == "row":
        return torch.cat(pieces, dim=1)
    if spec.kind == "kv_replicated":
        return torch.cat([pieces[h * spec.kv_share] for h in range(spec.num_heads)], dim=0)
    if spec.kind == "vocab":
        return torch.cat(pieces, dim=0)[: spec.full_rows]
    if spec.blocks:
        split = [p.split([b // len(pieces) for b in spec.blocks]) for p in pieces]
    else:
        split = [p.chunk(spec.chunks, dim=0) for p in pieces]
    return torch.cat([torch.cat([s[c] for s in split], dim=0) for c in range(len(split[0]))], dim=0)


def _pad_rows(t: torch.Tensor, degree: int) -> torch.Tensor:
    extra = (-t.shape[0]) % degree
    if not extra:
        return t
    return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))], dim=0)


def padded_size(n: int, degree: int) -> int:
    return n + (-n) % degree


def copy_into(param: nn.Parameter, full: torch.Tensor, shard: int, degree: int) -> None:
    spec: ShardSpec = param.tp_spec  # type: ignore[attr-defined]
    if full.is_meta:  # built empty: the rank reads its own slice later (disagg_llm_tp.load)
        return
    with torch.no_grad():
        param.copy_(local_slice(full.detach(), spec, shard, degree))


def mark(param: nn.Parameter, spec: ShardSpec) -> None:
    param.tp_spec = spec  # type: ignore[attr-defined]
