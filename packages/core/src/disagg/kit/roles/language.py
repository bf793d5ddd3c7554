"""The language-model role: forward and backward of the loss over this
replica's samples (embeddings from the encoders are leaves whose gradients go
back), and forward-only evaluation."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from disagg.interfaces.context import GroupContext
from disagg.interfaces.family import Family, LanguageFamily
from disagg.interfaces.strategy import DEFAULT_CHUNK_TOKENS
from disagg.kit import chunked_loss
from disagg.kit.recompute import Recompute


class LanguageRole:
    """Defaults for an LLM whose logits each rank holds whole; the hooks are
    :class:`~.parallelizer.Parallelizer`'s."""

    # what this role uses of the strategy it is part of (its Parallelizer's hooks)
    ctx: GroupContext
    family: Family
    module: nn.Module | None
    options: Any
    recompute: Recompute
    if TYPE_CHECKING:

        def module_call(self) -> AbstractContextManager[None]: ...

        def backprop(
            self, tensors: list[torch.Tensor], grads: list[torch.Tensor] | None, leaves: list[torch.Tensor]
        ) -> None: ...

    def loss_and_backward(
        self,
        mb: int,
        inputs: list[dict[str, torch.Tensor]],
        embeds: list[dict[str, torch.Tensor]],
        loss_scale: float,
    ) -> float:
        """Forward + backward of ``sum(token losses) * loss_scale``; return the
        unscaled loss sum of this replica's samples (counted once per replica).
        ``embeds`` are leaves; after this returns, their ``.grad`` must hold the
        complete gradient on the ranks for which :meth:`returns_input_grads` is
        true (TP strategies reduce it across TP ranks first). A replica with no
        sample in this microbatch is called too (``inputs`` empty)."""
        leaves = [t for e in embeds for t in e.values() if t.requires_grad]
        with self.module_call():
            if not inputs:  # still joins what module_call and backprop do collectively
                self.backprop([], None, leaves)
                return 0.0
            loss_sum = self.chunked_loss(inputs, embeds)
            self.backprop([loss_sum * loss_scale], None, leaves)
            return float(loss_sum.detach())

    def chunked_loss(
        self, inputs: list[dict[str, torch.Tensor]], embeds: list[dict[str, torch.Tensor]]
    ) -> torch.Tensor:
        """:meth:`loss_sum` of the family's logits, one ``parallel.llm.loss_chunk_tokens``
        chunk of them at a time (:mod:`disagg.kit.chunked_loss`)."""
        assert self.module is not None
        head = chunked_loss.output_head(self.family, self.module)
        if head is None:
            return self.loss_sum(*self.llm_forward(inputs, embeds))
        with chunked_loss.deferred(head):
            hidden, labels = self.llm_forward(inputs, embeds)
        chunk = getattr(self.options, "loss_chunk_tokens", DEFAULT_CHUNK_TOKENS)
        return chunked_loss.loss_sum(
            head, hidden, labels, self.token_losses, chunk, self.recompute.checkpoint
        )

    def token_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each token's cross-entropy in fp32 (0 where the label is ``-100``); strategies
        whose logits are split over the vocabulary override it."""
        return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="none")

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of token cross-entropies over the label tokens (``-100``: not a label)."""
        return chunked_loss.total(self.token_losses(logits, labels), labels)

    def llm_forward(
        self, inputs: list[dict[str, torch.Tensor]], embeds: list[dict[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The family's ``(logits, labels)`` through this strategy's module;
        strategies that wrap the module in an engine override it."""
        assert isinstance(self.family, LanguageFamily) and self.module is not None
        return self.family.forward(self.module, inputs, embeds)

    def correct_predictions(self, logits: torch.Tensor, labels: torch.Tensor) -> int:
        """Label tokens whose argmax prediction is right; strategies whose
        logits are split over the vocabulary override it."""
        mask = labels != -100
        return int((logits.argmax(-1)[mask] == labels[mask]).sum())

    def evaluate(
        self, inputs: list[dict[str, torch.Tensor]], embeds: list[dict[str, torch.Tensor]]
    ) -> tuple[float, int, int]:
        """Forward only (called under ``no_grad``, on every replica, with or
        without samples): ``(loss sum, label tokens whose argmax prediction is
        right, label tokens)``."""
        with self.module_call():
            if not inputs:
                return 0.0, 0, 0
            head = chunked_loss.output_head(self.family, self.module)
            if head is None:
                logits, labels = self.llm_forward(inputs, embeds)
                loss, right = self.loss_sum(logits, labels), self.correct_predictions(logits, labels)
            else:
                with chunked_loss.deferred(head):
                    hidden, labels = self.llm_forward(inputs, embeds)
                chunk = getattr(self.options, "loss_chunk_tokens", DEFAULT_CHUNK_TOKENS)
                loss, right = chunked_loss.evaluate(
                    head, hidden, labels, self.token_losses, self.correct_predictions, chunk
                )
            return float(loss), right, int((labels != -100).sum())

    def returns_input_grads(self) -> bool:
        """Whether this rank sends embedding gradients back to the encoders.
        Core routes them from the first shard of each replica only."""
        return self.ctx.shard == 0
