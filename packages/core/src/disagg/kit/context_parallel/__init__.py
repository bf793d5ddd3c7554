"""Context parallelism for a decoder (``parallel.llm.context_parallel``): each of a
replica's ``N`` context-parallel ranks holds 1/N of every sample's tokens, split load-balanced
for causal attention (:mod:`.split`); attention all-gathers keys and values over the ranks
(:mod:`.gather`, :mod:`.attention`); each rank gets only the encoder rows of its own tokens
(:mod:`.routing`), and the language role's loss and evaluation counts are summed over the ranks
(a hook, :meth:`.state.ContextParallel.sum_figures`). A strategy composes it by calling
:func:`apply` in its ``parallelize`` (torchtitan's ``apply_cp`` step), no base class to inherit;
a family's forward reads :func:`current` (:mod:`.state`).

Why an all-gather of K/V (Llama-3's choice) and not a ring or an all-to-all: with
grouped-query attention K and V are ``kv_heads / heads`` of Q (1/8 at Qwen2.5-32B's 8 of
64), so gathering them moves ``(N-1)/N x 2 x tokens x kv_heads x head_dim`` elements per
layer per rank in one call (the same reduce-scattered in backward); a ring sends the same
bytes in ``N-1`` latency-bound steps, and an all-to-all over heads caps ``N`` at the KV head
count. torch's ``torch.distributed.tensor.experimental.context_parallel`` (2.13) is not used:
its ring replaces only the CUDA SDPA kernels (``_scaled_dot_product_flash/efficient/cudnn_attention``
in ``_context_parallel/_attention.py``), so it never runs on our CPUs with gloo, and those take
``is_causal`` only, not the mask of a rank's two non-contiguous chunks (docs/strategies.md).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from disagg.interfaces.context import GroupContext
from disagg.kit.context_parallel import attention
from disagg.kit.context_parallel.split import gathered_order, local_positions, padded_length, split
from disagg.kit.context_parallel.state import ContextParallel, current, install

__all__ = [
    "ContextParallel",
    "apply",
    "current",
    "gathered_order",
    "local_positions",
    "padded_length",
    "split",
]


def apply(module: nn.Module, ctx: GroupContext, role: Any = None) -> nn.Module:
    """The context-parallel step of a strategy's ``parallelize`` (collective over the group):
    make the groups, switch ``module``'s attention to the gathering one and hook the sum of the
    loss and evaluation counts over the ranks into the language ``role`` (the strategy, a
    :class:`~disagg.kit.roles.LanguageRole`); nothing at 1."""
    cp = install(ctx)
    if cp is not None:
        attention.use(module)
        if role is not None:
            role.replica_sum = cp.sum_figures
    return module
