"""The language-model role: forward and backward of the loss over this
replica's samples (embeddings from the encoders are leaves whose gradients go
back), and forward-only evaluation."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from disagg.interfaces.context import GroupContext
from disagg.interfaces.family import Family, LanguageFamily
from disagg.interfaces.strategy import DEFAULT_CHUNK_TOKENS
from disagg.kit import chunked_loss
from disagg.kit.lockstep import placeholder_sample, without_dropout
from disagg.kit.recompute import Recompute


class LanguageRole:
    """Defaults for an LLM whose logits each rank holds whole; the hooks are
    :class:`~.parallelizer.Parallelizer`'s. Under a FSDP2-sharded state (``ddp`` with
    ``shard: gradients | parameters``) the forward runs through the root unit, and a replica
    without samples forwards the family's placeholder sample (:mod:`disagg.kit.lockstep`,
    *known* count: one forward per replica and microbatch), whose loss and gradient are zero."""

    # what this role uses of the strategy it is part of (its Parallelizer's hooks)
    ctx: GroupContext
    family: Family
    module: nn.Module | None
    options: Any
    recompute: Recompute
    fsdp: bool
    #: turns this rank's loss and evaluation figures into its replica's; None: they are already
    #: (context parallelism installs the sum over the ranks that share the samples, from
    #: :func:`disagg.kit.context_parallel.apply`)
    replica_sum: Callable[[list[float]], list[float]] | None = None
    if TYPE_CHECKING:

        def sharded_call(self, fn: Any, *args: Any) -> Any: ...

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
            if not inputs and not self.fsdp:  # still joins what module_call and backprop do collectively
                self.backprop([], None, leaves)
                return 0.0
            with self._lockstep(inputs, embeds) as (inputs, embeds):
                loss_sum = self._whole_call(self.chunked_loss, inputs, embeds)
            # a placeholder's loss is 0 with a zero gradient: its backward issues the group's
            # gathers and reduce-scatters and adds exact zeros
            self.backprop([loss_sum * loss_scale], None, leaves)
            return self._over_replica([float(loss_sum.detach())])[0]

    def _over_replica(self, figures: list[float]) -> list[float]:
        return figures if self.replica_sum is None else self.replica_sum(figures)

    @contextlib.contextmanager
    def _lockstep(self, inputs: list[dict[str, torch.Tensor]], embeds: list[dict[str, torch.Tensor]]) -> Any:
        """``(inputs, embeds)``, or for a replica without samples under FSDP2 the family's
        placeholder sample, forwarded without dropout (its random stream stays put)."""
        if inputs or not self.fsdp:
            yield inputs, embeds
            return
        assert self.module is not None
        with without_dropout(self.module):
            yield [placeholder_sample(self.family)], [{}]

    def _whole_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` (the forward, its loss chunks included), under FSDP2 as one forward of
        the root unit, so the parameters outside the blocks (embeddings, norm, head) are
        gathered around it and their gradients reduce-scattered with the blocks'."""
        if not self.fsdp:
            return fn(*args)
        return self.sharded_call(lambda _module, *a: fn(*a), *args)

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
            if not inputs and not self.fsdp:
                return 0.0, 0, 0
            with self._lockstep(inputs, embeds) as (xs, es):
                loss, right, labelled = self._whole_call(self._evaluate, xs, es)
            loss, right, labelled = (float(loss), right, labelled) if inputs else (0.0, 0, 0)
            total, right, labelled = self._over_replica([loss, right, labelled])
            return total, int(round(right)), int(round(labelled))

    def _evaluate(
        self, inputs: list[dict[str, torch.Tensor]], embeds: list[dict[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, int, int]:
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
        return loss, right, int((labels != -100).sum())

    def returns_input_grads(self) -> bool:
        """Whether this rank sends embedding gradients back to the encoders.
        Core routes them from the first shard of each replica only."""
        return self.ctx.shard == 0
