"""The language model's loss over chunks of tokens (``parallel.llm.loss_chunk_tokens``).

Why: a decoder's logits are tokens x vocabulary, and the loss upcasts them to fp32. Hugging
Face computes them whole: at 16k tokens and Qwen2.5's 152k vocabulary one fp32 copy is 10 GB,
and the loss keeps two. Here the family's forward runs with its output head *deferred* (the
head returns its input, so the family hands back the shifted, flattened hidden states the head
would have read), and the head is applied to one chunk of tokens at a time inside a
checkpointed region (:meth:`disagg.kit.recompute.Recompute.checkpoint`): the forward
keeps only each chunk's input (rows of the hidden states, which autograd keeps anyway), and the
backward replays one chunk at a time, so one chunk's logits exist at once, in forward and in
backward. The strategy's own per-token loss runs on each chunk, so ``megatron_tp`` keeps its
vocabulary-parallel cross entropy (three all-reduces per chunk instead of per microbatch).

The head is the family's :attr:`LayerMap.output` module: by the layer map's definition its
output *is* the logits (nothing but the shift and flatten comes after it). A family without a
layer map, or with no single output module, gets the whole logits, as before.

Same numbers: per-token losses are computed per chunk and summed once over all tokens by
``nll_loss``, the summation ``cross_entropy(reduction="sum")`` itself does, so with one chunk
the loss, every gradient and the prediction count are the unchunked ones bit for bit (the same
operations on the same operands). With several chunks each token's loss and each row of the
hidden states' gradient are the unchunked ones exactly when the matmul computes a row the same
way whatever the number of rows it is given: BLAS kernels block rows (MKL's AVX-512 sgemm in
fours), so a chunk size that is a multiple of the block keeps them equal, which no library
promises. The head's weight gradient is a sum over tokens, and chunked it is a sum of per-chunk
matmuls, another summation order: equal within the tolerance policy, never bit for bit.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterator

import torch
from torch import nn

from disagg.interfaces.family import Family

TokenLosses = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def output_head(family: Family, module: nn.Module) -> nn.Module | None:
    """The one module of ``module`` matched by ``family``'s ``LayerMap.output`` patterns;
    ``None`` when the family has no layer map or it does not name exactly one."""
    lmap = family.layer_map()
    if lmap is None or not lmap.output:
        return None
    found = [m for n, m in module.named_modules() if n and any(fnmatch.fnmatch(n, p) for p in lmap.output)]
    return found[0] if len(found) == 1 else None


def _passthrough(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return x


@contextlib.contextmanager
def deferred(head: nn.Module) -> Iterator[None]:
    """Inside the block ``head(x)`` returns ``x`` (its hooks still run): the family's forward
    then returns the hidden states in place of the logits."""
    head.forward = _passthrough  # an instance attribute wins over the class's forward
    try:
        yield
    finally:
        del head.forward


def total(losses: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``sum(losses)`` over the label tokens with the summation of
    ``cross_entropy(logits, labels, ignore_index=-100, reduction="sum")`` (``nll_loss`` over
    the same tokens in the same order), so one chunk gives that loss bit for bit."""
    target = torch.where(labels != -100, 0, -100)
    return torch.nn.functional.nll_loss(-losses[:, None], target, ignore_index=-100, reduction="sum")


def bounds(tokens: int, chunk: int | None) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk of ``tokens`` rows (one chunk when ``chunk`` is None)."""
    if not chunk or tokens <= chunk:
        return [(0, tokens)]
    return [(s, min(s + chunk, tokens)) for s in range(0, tokens, chunk)]


def loss_sum(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    token_losses: TokenLosses,
    chunk: int | None,
    checkpoint: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """The summed token losses of ``head(hidden)``, one chunk of rows at a time; with
    gradients each chunk is ``checkpoint``ed (only its input kept; replayed in backward)."""

    def one(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return token_losses(head(h), y)

    spans = bounds(hidden.shape[0], chunk)
    if len(spans) == 1:  # its logits are at most one chunk: nothing to replay
        return total(one(hidden, labels), labels)
    parts = []
    for s, e in spans:
        h, y = hidden[s:e], labels[s:e]
        parts.append(checkpoint(one, h, y) if torch.is_grad_enabled() else one(h, y))
    return total(torch.cat(parts), labels)


def evaluate(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    token_losses: TokenLosses,
    correct: Callable[[torch.Tensor, torch.Tensor], int],
    chunk: int | None,
) -> tuple[torch.Tensor, int]:
    """Forward only: the summed token losses and the right argmax predictions, one chunk's
    logits at a time."""
    parts, right = [], 0
    for s, e in bounds(hidden.shape[0], chunk):
        logits, y = head(hidden[s:e]), labels[s:e]
        parts.append(token_losses(logits, y))
        right += correct(logits, y)
    return total(torch.cat(parts), labels), right
