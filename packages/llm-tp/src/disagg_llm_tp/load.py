"""Each TP rank reads only its own slices of the stored tensors.

The family builds its module on the meta device (:meth:`Family.build_empty`);
:func:`~disagg_llm_tp.parallelize.parallelize_module` swaps in megatron's
layers, which allocate only this rank's piece; here every parameter still on
the meta device (norms and other replicated tensors) gets real storage and
every parameter reads its piece from the checkpoint's safetensors through
``get_slice``, cast to the module's dtype on the way. Each piece is what
:func:`~disagg_llm_tp.layers.local_slice` cuts from the full tensor, so the
result equals loading the whole module and slicing it (the test asserts it
exactly); the full tensor of a split parameter never exists on any rank.
"""

from __future__ import annotations

import torch
from torch import nn

from disagg.interfaces import Family
from disagg.interfaces.stored import StoredTensors
from disagg_llm_tp.shard_spec import ShardSpec, mark, padded_size

#: (local first row, stored first row, rows, stored columns)
Piece = tuple[int, int, int, slice]


#: rows read per call: a read's copy is the only transient beside the rank's own tensors
BLOCK_BYTES = 16 << 20


def local_pieces(spec: ShardSpec, shape: list[int], shard: int, degree: int) -> list[Piece]:
    """Where this rank's piece of a stored tensor of ``shape`` comes from (as
    :func:`~disagg_llm_tp.layers.local_slice` cuts the full one): ``(local first row,
    stored first row, rows, stored columns)`` each; local rows no piece covers are the
    vocabulary's padding (zeros, as ``_pad_rows`` makes them)."""
    every = slice(None)
    if spec.kind == "replicated" or (degree == 1 and spec.kind != "vocab") or not shape:
        return [(0, 0, shape[0] if shape else 0, every)]
    if spec.kind == "row":
        k = shape[1] // degree
        return [(0, 0, shape[0], slice(shard * k, (shard + 1) * k))]
    if spec.kind == "kv_replicated":
        per = shape[0] // spec.num_heads
        return [(0, spec.head * per, per, every)]
    if spec.kind == "vocab":
        m = padded_size(shape[0], degree) // degree
        start, end = shard * m, min((shard + 1) * m, shape[0])
        return [(0, start, end - start, every)] if end > start else []
    # fused q/k/v (equal ``chunks`` or unequal ``blocks``): this rank's rows of each block
    sizes = list(spec.blocks) or [shape[0] // spec.chunks] * spec.chunks
    pieces, local, start = [], 0, 0
    for block in sizes:
        m = block // degree
        pieces.append((local, start + shard * m, m, every))
        local, start = local + m, start + block
    return pieces


def read_into(
    t: torch.Tensor,
    stored: StoredTensors,
    key: str,
    shape: list[int],
    spec: ShardSpec,
    shard: int,
    degree: int,
) -> int:
    """Fill the local tensor ``t`` with its piece of stored ``key`` (of ``shape``), cast
    on the way, a block of rows per read; returns the bytes read."""
    if not shape:  # a scalar
        t.copy_(stored.read(key, dtype=t.dtype))
        return t.element_size()
    row_bytes = t.element_size() * max(1, t[0].numel() if t.dim() else 1)
    step = max(1, BLOCK_BYTES // row_bytes)
    covered, read = 0, 0
    for dst, src, rows, cols in local_pieces(spec, shape, shard, degree):
        for r in range(0, rows, step):
            n = min(step, rows - r)
            index = (
                (slice(src + r, src + r + n),) if cols == slice(None) else (slice(src + r, src + r + n), cols)
            )
            piece = stored.read(key, index, dtype=t.dtype)
            t[dst + r : dst + r + n].copy_(piece)
            read += piece.numel() * piece.element_size()
        covered = max(covered, dst + rows)
    t[covered:].zero_()  # vocabulary padding
    return read


def materialize(module: nn.Module) -> None:
    """Give every parameter and buffer still on the meta device empty CPU storage of its
    (already local) shape, keeping its shard spec and tied parameters tied."""
    new: dict[int, torch.Tensor] = {}
    for owner in module.modules():
        for table, is_param in ((owner._parameters, True), (owner._buffers, False)):
            for leaf, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in new:
                    value = torch.empty(t.shape, dtype=t.dtype)
                    if is_param:
                        value = nn.Parameter(value, requires_grad=t.requires_grad)
                    if hasattr(t, "tp_spec"):
                        mark(value, t.tp_spec)
                    new[id(t)] = value
                table[leaf] = new[id(t)]


def load_local(module: nn.Module, family: Family, shard: int, degree: int) -> dict[str, int]:
    """Fill the parallelized ``module`` (built empty) with this rank's slices of
    ``family.path``'s tensors; returns the bytes read per stored key."""
    materialize(module)
    stored = family.stored_tensors()  # the dir's, plus any part the family draws (a seeded projector)
    persistent = {n for n, _ in module.named_buffers()} - _non_persistent(module)
    tensors = [*module.named_parameters(), *((n, b) for n, b in module.named_buffers() if n in persistent)]
    read: dict[str, int] = {}
    with torch.no_grad():
        for name, t in tensors:
            key = family.checkpoint_name(name)
            if key is None or key not in stored:
                raise KeyError(
                    f"family {family.name!r}: {family.path} stores no tensor for {name!r}"
                    + (f" (looked for {key!r})" if key else "")
                )
            spec = getattr(t, "tp_spec", ShardSpec("replicated"))
            shape = stored.shape(key)
            _check_shape(shape, spec, t, degree, f"{family.path}: {key!r} for {name!r}")
            read[key] = read.get(key, 0) + read_into(t, stored, key, shape, spec, shard, degree)
    return read


def _check_shape(stored: list[int], spec: ShardSpec, t: torch.Tensor, degree: int, what: str) -> None:
    want = list(t.shape)
    got = list(stored)
    if got and spec.kind in ("column", "vocab"):
        got[0] = padded_size(got[0], degree) // degree if spec.kind == "vocab" else got[0] // degree
    elif got and spec.kind == "kv_replicated":
        got[0] //= spec.num_heads
    elif spec.kind == "row":
        got[1] //= degree
    if got != want:
        raise ValueError(f"{what}: stored as {stored}, which cuts to {got} for this rank; it holds {want}")


def _non_persistent(module: nn.Module) -> set[str]:
    out = set()
    for prefix, owner in module.named_modules():
        for leaf in getattr(owner, "_non_persistent_buffers_set", ()):
            out.add(f"{prefix}.{leaf}" if prefix else leaf)
    return out
