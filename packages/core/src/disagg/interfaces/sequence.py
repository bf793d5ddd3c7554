"""Hook points of sequence-parallel encoder families (driven by ``ulysses``, disagg-vision-sp).

They live in core, like :class:`~disagg.interfaces.LayerMap` for tensor
parallelism, so that a family in any plugin (vision, audio) can describe
itself for ``ulysses`` without depending on the plugin that runs it.

A family that supports ``ulysses`` describes one microbatch as a single token
sequence in *compute order* (all media items of all samples concatenated,
after any reordering such as Qwen2.5-VL's window permutation) and runs its HF
submodules on one contiguous slice of it. It never communicates: it only says
which attention spans beyond the slice (``scope.spanning(segments)``). The
strategy decides where to cut and does the all-to-all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn


@dataclass
class SeqLayout:
    """Global layout of one microbatch, identical on every rank of a replica."""

    #: encoder tokens in compute order (all samples)
    n_tokens: int
    #: offsets where a shard may start or end (sorted; 0 and n_tokens included),
    #: e.g. window boundaries so that window attention stays local
    cuts: list[int]
    #: encoder tokens per output row (Qwen2.5-VL merges 2x2 patches: 4); cuts are multiples of it
    unit: int
    #: per output row in compute order: which sample it belongs to (-1: a row the
    #: family computes but the LLM never receives, such as CLIP's CLS token)...
    row_sample: torch.Tensor
    #: ...and which row of that sample's full embedding (LLM placeholder order) it is
    row_pos: torch.Tensor
    #: output rows of each sample's full embedding
    sample_rows: list[int]
    #: anything the family precomputed for the whole sequence (rotary ids, window index, ...)
    extra: dict[str, Any] = field(default_factory=dict)


class AttentionScope(Protocol):
    def spanning(self, segments: list[int]) -> AbstractContextManager[None]:
        """Attention run inside attends across shards within ``segments``
        (global lengths in compute order). Outside it, attention is local."""
        ...


class UlyssesFamily(ABC):
    """Mixin for an :class:`~disagg.interfaces.EncoderFamily` that ``ulysses`` can shard."""

    @abstractmethod
    def ulysses_heads(self) -> int:
        """Attention heads of every layer that may span shards."""

    @abstractmethod
    def ulysses_layout(self, inputs: list[dict[str, torch.Tensor]]) -> SeqLayout:
        """The compute-order layout of a microbatch (one input dict per sample)."""

    @abstractmethod
    def ulysses_forward(
        self,
        module: nn.Module,
        inputs: list[dict[str, torch.Tensor]],
        layout: SeqLayout,
        lo: int,
        hi: int,
        scope: AttentionScope,
    ) -> torch.Tensor:
        """Forward of tokens ``[lo, hi)`` (compute order) -> their output rows
        ``[(hi - lo) // unit, hidden]``. Runs the HF submodules of ``module``
        whose attention implementation is ``disagg_ulysses_flash``."""

    def ulysses_attention_modules(self, module: nn.Module) -> list[nn.Module]:
        """The (sub)models whose ``config._attn_implementation`` ulysses replaces."""
        return [m for m in module.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]
