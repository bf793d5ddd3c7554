"""The attention function of a context-parallel decoder, registered with transformers'
public ``AttentionInterface`` under :data:`NAME`.

Each rank holds the queries, keys and values of its own tokens. Keys and values are
all-gathered over the context-parallel group (:mod:`.gather`), put in sequence order, repeated
for grouped-query heads only after the gather (so the wire carries the ``kv_heads``), and the
local queries attend under the causal mask of their *global* positions. Right padding needs no
mask: a real token never sees a later (padding) key. Without an active split it is SDPA.
"""

from __future__ import annotations

from typing import Any

import torch

from disagg.kit.context_parallel.gather import gather_sequence
from disagg.kit.context_parallel.state import current

#: the ``attn_implementation`` name a context-parallel module runs
NAME = "disagg_context_parallel"


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    cp = current()
    if cp is None or cp.positions is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    assert cp.order is not None
    key = gather_sequence(key, cp.order, cp.group, cp.comm)
    value = gather_sequence(value, cp.order, cp.group, cp.comm)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    keys = torch.arange(key.shape[2], device=query.device)
    causal = cp.positions.to(query.device)[:, None] >= keys[None, :]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=causal, dropout_p=dropout, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register :func:`attention` with transformers (idempotent); return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    return NAME


def use(module: torch.nn.Module) -> None:
    """Every (sub)model config of ``module`` runs :func:`attention`."""
    register()
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = NAME  # noqa: SLF001  (what set_attn_implementation writes)
