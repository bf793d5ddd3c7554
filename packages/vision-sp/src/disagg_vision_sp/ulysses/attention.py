"""Ulysses attention, plugged into Hugging Face's ``AttentionInterface``.

HF attention modules compute q/k/v, then call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``.
We register one more implementation, ``disagg_ulysses_flash``. Its name says
"flash" on purpose: HF's packed-sequence attentions (Qwen2.5-VL's vision
blocks) then make one varlen call per block with ``cu_seq_lens_q`` instead of
a Python loop with one attention call per window and a host sync (144 windows
x 28 blocks for one 1344 x 1344 image). We do the varlen call with the real
backend: one ``flash_attention_2`` call, or, for sdpa and eager, one batched
call per distinct window length (usually up to four: whole windows and the
image's edges), never a mask over the whole sequence. Outside a
:meth:`UlyssesRuntime.spanning` scope it just calls the real backend (sdpa,
eager, flash_attention_2) on the rank's own tokens: attention that is local by
construction (Qwen2.5-VL windows cut on window boundaries) moves no bytes.
Inside the scope, q/k/v of the local sequence shard are turned into head shards
of the whole sequence with one all-to-all, attention runs per global segment,
and a second all-to-all turns the output back into a sequence shard. Both
all-to-alls are torch's autograd-aware collective, so backward is torch's own.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from disagg.interfaces.comm import CommCounter
from disagg.kit.collectives import all_to_all_rows
from disagg.kit.recompute import Recompute

ATTN_NAME = "disagg_ulysses_flash"
#: keyword a caller passes through HF's block to give the segment lengths from
#: host memory (``cu_seq_lens_q`` is on the device: reading it is a sync)
LENGTHS_KWARG = "disagg_segment_lengths"
#: HF's varlen keywords, which only a flash backend takes
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

_RUNTIME: ContextVar["UlyssesRuntime | None"] = ContextVar("disagg_ulysses_runtime", default=None)


@dataclass
class UlyssesRuntime:
    """What the attention function needs for one encoder forward on one rank."""

    #: backend that does the actual attention math ("sdpa", "eager", "flash_attention_2")
    base: str
    #: ranks sharing this replica's sequence (None with degree 1)
    group: dist.ProcessGroup | None
    degree: int
    shard: int
    #: tokens held by each shard of the group, in shard order (global order = shard-major)
    sizes: list[int]
    comm: CommCounter
    #: global segment lengths of the attention in scope; None = local attention
    segments: list[int] | None = field(default=None)
    #: the module's recomputation: ``selective`` checkpoints the attention core below
    recompute: Recompute | None = field(default=None)

    @contextlib.contextmanager
    def active(self) -> Iterator[UlyssesRuntime]:
        token = _RUNTIME.set(self)
        try:
            yield self
        finally:
            _RUNTIME.reset(token)

    @contextlib.contextmanager
    def restored(self, segments: list[int] | None) -> Iterator[None]:
        """Active again with the segments a checkpointed block saw at its forward
        (its replay runs in backward, outside :meth:`active`)."""
        token, previous = _RUNTIME.set(self), self.segments
        self.segments = segments
        try:
            yield
        finally:
            self.segments = previous
            _RUNTIME.reset(token)

    @contextlib.contextmanager
    def spanning(self, segments: list[int]) -> Iterator[None]:
        """Attention calls inside attend across shards, within ``segments``
        (lengths, in compute order, summing to the global token count)."""
        if sum(segments) != sum(self.sizes):
            raise ValueError(f"segments cover {sum(segments)} tokens, shards hold {sum(self.sizes)}")
        previous, self.segments = self.segments, list(segments)
        try:
            yield
        finally:
            self.segments = previous


def current() -> UlyssesRuntime | None:
    """The runtime of the forward in progress (None outside one)."""
    return _RUNTIME.get()


def _core(rt: UlyssesRuntime, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The attention core, checkpointed when the module recomputes it selectively."""
    if rt.recompute is None:
        return fn(*args, **kwargs)
    return rt.recompute.attention(fn, *args, **kwargs)


def register() -> None:
    """Make ``disagg_ulysses`` a valid ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, ulysses_attention_forward)


def base_attention(name: str) -> Callable[..., tuple[torch.Tensor, Any]]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        from transformers.models.siglip.modeling_siglip import eager_attention_forward

        # Every HF eager implementation is this softmax(QK^T)V with optional mask.
        return eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def ulysses_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention signature: q/k/v ``[1, heads, n_local, head_dim]`` ->
    ``[1, n_local, heads, head_dim]``."""
    rt = _RUNTIME.get()
    if rt is None:
        raise RuntimeError(f"attn_implementation {ATTN_NAME!r} used outside a ulysses forward")
    lengths = kwargs.pop(LENGTHS_KWARG, None)
    cu = kwargs.get("cu_seq_lens_q")
    varlen = {k: kwargs.pop(k) for k in _VARLEN_KWARGS if k in kwargs}
    if query.shape[2] == 0 and rt.segments is None:
        return query.transpose(1, 2), None  # an empty local shard: nothing to attend
    if rt.segments is None:
        if cu is None:  # a plain call (CLIP, SigLIP, Whisper): the backend as the model asked
            out, _ = _core(rt, base_attention(rt.base), module, query, key, value, attention_mask, **kwargs)
            return out, None
        if lengths is None:
            lengths = _lengths(cu)  # one host sync per call: callers that can pass LENGTHS_KWARG
        if attention_mask is not None:
            raise ValueError("varlen attention takes no attention_mask; got one")
        if "flash" in rt.base:
            out, _ = _core(rt, base_attention(rt.base), module, query, key, value, None, **varlen, **kwargs)
            return out, None
        return _core(rt, _segmented, rt.base, module, query, key, value, lengths, kwargs), None
    if attention_mask is not None:
        raise ValueError("ulysses attention builds its own segment masks; got an attention_mask")
    return _spanning_attention(rt, module, query, key, value, kwargs), None


def _spanning_attention(
    rt: UlyssesRuntime,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    heads, n, head_dim = query.shape[1], query.shape[2], query.shape[3]
    d = rt.degree
    if heads % d:
        raise ValueError(f"{heads} attention heads are not divisible by the ulysses degree {d}")
    hl = heads // d
    # [3, H, n, D] -> rows grouped by destination shard: chunk j = my tokens, heads of shard j.
    qkv = torch.stack([query[0], key[0], value[0]])
    qkv = qkv.view(3, d, hl, n, head_dim).permute(1, 3, 0, 2, 4).reshape(d * n, 3, hl, head_dim)
    qkv = _all_to_all(rt, qkv, out_splits=rt.sizes, in_splits=[n] * d)  # [N, 3, hl, D], global order
    q, k, v = (t.unsqueeze(0) for t in qkv.permute(1, 2, 0, 3).unbind(0))  # each [1, hl, N, D]

    out = _core(rt, _segmented, rt.base, module, q, k, v, rt.segments or [], kwargs)[0]  # [N, hl, D]
    out = _all_to_all(rt, out.contiguous(), out_splits=[n] * d, in_splits=rt.sizes)  # [d*n, hl, D]
    return out.view(d, n, hl, head_dim).permute(1, 0, 2, 3).reshape(1, n, heads, head_dim)


def _segmented(
    base: str,
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: list[int],
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Block-diagonal attention over ``segments`` of ``[1, h, N, D]`` -> ``[1, N, h, D]``."""
    fn = base_attention(base)
    kwargs = {k: v for k, v in kwargs.items() if k in ("scaling", "dropout")}
    if "flash" in base:
        cu = torch.tensor([0] + segments, device=q.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        out, _ = fn(
            module,
            q,
            k,
            v,
            None,
            is_causal=False,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max(segments),
            max_length_k=max(segments),
            **kwargs,
        )
        return out
    return _batched_by_length(fn, module, q, k, v, segments, kwargs)


def _lengths(cu: torch.Tensor) -> list[int]:
    bounds = [int(x) for x in cu.tolist()]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _batched_by_length(
    fn: Callable[..., tuple[torch.Tensor, Any]],
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: list[int],
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Block-diagonal attention as one batched call per distinct segment length:
    segments of one length are stacked as a batch (each attends only to itself,
    as in the per-segment loop), so no FLOP is spent outside the blocks.
    ``[1, h, N, D]`` -> ``[1, N, h, D]``."""
    h, n, d = q.shape[1], q.shape[2], q.shape[3]
    segments = [s for s in segments if s]
    if sum(segments) != n:
        raise ValueError(f"segments cover {sum(segments)} tokens of {n}")
    starts = [0]
    for s in segments[:-1]:
        starts.append(starts[-1] + s)
    by_length: dict[int, list[int]] = {}
    for i, s in enumerate(segments):
        by_length.setdefault(s, []).append(i)

    def batch(t: torch.Tensor, length: int, count: int) -> torch.Tensor:
        return t[0].reshape(h, count, length, d).transpose(0, 1)  # [count, h, length, d]

    if len(by_length) == 1:  # every segment one length: a view, no gather
        ((length, idx),) = by_length.items()
        out = fn(module, *(batch(t, length, len(idx)) for t in (q, k, v)), None, is_causal=False, **kwargs)[0]
        return out.reshape(1, n, h, d)
    # gather each length's tokens together (one index built on the host), attend, scatter back
    order = torch.cat(
        [torch.arange(starts[i], starts[i] + length) for length, idx in by_length.items() for i in idx]
    ).to(q.device)
    qs, ks, vs = (t.index_select(2, order) for t in (q, k, v))
    parts, at = [], 0
    for length, idx in by_length.items():
        span = length * len(idx)
        chunk = [batch(t[:, :, at : at + span], length, len(idx)) for t in (qs, ks, vs)]
        parts.append(fn(module, *chunk, None, is_causal=False, **kwargs)[0])
        at += span
    gathered = torch.cat([p.reshape(-1, h, d) for p in parts])  # [N, h, d] in `order`
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n, device=order.device)
    return gathered.index_select(0, inverse).unsqueeze(0)


def _all_to_all(
    rt: UlyssesRuntime, x: torch.Tensor, out_splits: list[int], in_splits: list[int]
) -> torch.Tensor:
    """Autograd-aware all-to-all along dim 0, with every byte counted (both directions)."""
    if rt.degree == 1:
        return x
    row_bytes = int(torch.Size(x.shape[1:]).numel()) * x.element_size()
    rt.comm.all_to_all_bytes(in_splits, rt.shard, row_bytes)
    y = all_to_all_rows(x, out_splits, in_splits, rt.group)
    if y.requires_grad:
        comm, shard = rt.comm, rt.shard

        # The gradient of y goes back to the ranks it came from: count it when it exists.
        def _count_backward(grad: torch.Tensor) -> None:
            comm.all_to_all_bytes(out_splits, shard, row_bytes)

        y.register_hook(_count_backward)
    return y
