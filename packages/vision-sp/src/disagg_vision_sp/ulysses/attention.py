"""Ulysses attention, plugged into Hugging Face's ``AttentionInterface``.

HF attention modules compute q/k/v, then call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``.
We register one more implementation, ``disagg_ulysses``. Outside a
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

ATTN_NAME = "disagg_ulysses"

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

    @contextlib.contextmanager
    def active(self) -> Iterator[UlyssesRuntime]:
        token = _RUNTIME.set(self)
        try:
            yield self
        finally:
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
    if query.shape[2] == 0 and rt.segments is None:
        return query.transpose(1, 2), None  # an empty local shard: nothing to attend
    if rt.segments is None:
        out, _ = base_attention(rt.base)(module, query, key, value, attention_mask, **kwargs)
        return out, None
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

    out = _segmented(rt.base, module, q, k, v, rt.segments or [], kwargs)[0]  # [N, hl, D]
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
    parts = [
        fn(module, qs, ks, vs, None, is_causal=False, **kwargs)[0]
        for qs, ks, vs in zip(*(t.split(segments, dim=2) for t in (q, k, v)))
    ]
    return torch.cat(parts, dim=1)


def _all_to_all(
    rt: UlyssesRuntime, x: torch.Tensor, out_splits: list[int], in_splits: list[int]
) -> torch.Tensor:
    """Autograd-aware all-to-all along dim 0, with every byte counted (both directions)."""
    if rt.degree == 1:
        return x
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    row_bytes = int(torch.Size(x.shape[1:]).numel()) * x.element_size()
    rt.comm.all_to_all_bytes(in_splits, rt.shard, row_bytes)
    y = all_to_all_single_autograd(x, out_splits, in_splits, rt.group)
    if y.requires_grad:
        comm, shard = rt.comm, rt.shard

        # The gradient of y goes back to the ranks it came from: count it when it exists.
        def _count_backward(grad: torch.Tensor) -> None:
            comm.all_to_all_bytes(out_splits, shard, row_bytes)

        y.register_hook(_count_backward)
    return y
