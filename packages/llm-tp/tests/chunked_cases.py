"""Rank function of the chunked-loss test (spawned ranks import it by name): one step of
``megatron_tp`` (or ``ddp``) with ``loss_chunk_tokens`` unset and set, from the same
weights, recording the loss, every merged gradient, the input-embedding gradients, the
evaluation tuple and the peak saved bytes of logits-shaped tensors."""

from __future__ import annotations

from typing import Any

import torch
from tp_cases import LR, Case, family_cls, label_count, replica_slice

from disagg.interfaces import OptimSpec
from disagg.kit.recompute.activations import SavedBytes
from disagg.testing import ranks
from disagg.testing.ranks import dumps, loads


class LogitsBytes(SavedBytes):
    """The activation metric's hooks (held saves, and each checkpoint replay's saves as a
    peak), counting only tensors whose last dimension is this rank's vocabulary slice."""

    def __init__(self, module: torch.nn.Module, vocab: int) -> None:
        self.held, self.replays = 0, [0]
        super().__init__(module, self._add, self.replays.append)
        self.vocab = vocab

    def _add(self, n: int) -> None:
        self.held += n

    def is_param(self, t: torch.Tensor) -> bool:  # "not counted": the weights (a transposed
        # head weight is vocabulary-wide too), and tensors of another width
        return super().is_param(t) or t.dim() == 0 or t.shape[-1] != self.vocab

    @property
    def most(self) -> int:
        return self.held + max(self.replays)


def one_step(strategy: str, case: Case, rank: int, chunk: int | None) -> dict[str, Any]:
    ctx = ranks.rank_context("llm", rank, case.degree, case.replicas)
    fam = family_cls(case.family)(case.path)
    if strategy == "megatron_tp":
        from disagg_llm_tp.strategy import MegatronTPOptions, MegatronTPStrategy

        opts = MegatronTPOptions(sequence_parallel=case.sequence_parallel, loss_chunk_tokens=chunk)
        strat: Any = ranks.strategy_rank(MegatronTPStrategy, fam, ctx, options=opts, optim=OptimSpec(lr=LR))
    else:
        from disagg.builtin.ddp import DDPStrategy

        options = {"loss_chunk_tokens": chunk}
        strat = ranks.strategy_rank(DDPStrategy, fam, ctx, options=options, optim=OptimSpec(lr=LR))
    samples = replica_slice(case.samples, ctx.replica, case.replicas)
    embeds = replica_slice(case.embeds, ctx.replica, case.replicas)
    out: dict[str, Any] = {"rank": rank}
    with torch.no_grad():
        out["eval"] = ranks.evaluate(strat, samples, embeds)
    leaves = ranks.leaves(embeds)
    start, end = getattr(getattr(strat, "plan", None), "output_range", (0, 0))
    vocab = end - start if end else fam.text_config.vocab_size
    with LogitsBytes(strat.module, vocab) as counter:
        out["loss"] = ranks.loss_and_backward(strat, 0, samples, leaves, 1.0 / label_count(case.samples))
    out["logits_bytes"] = counter.most
    out["vocab_local"] = vocab
    ranks.reduce_gradients(strat)
    out["grads"] = ranks.full_grads(strat)
    out["embed_grads"] = [{k: v.grad.clone() for k, v in e.items()} for e in leaves]
    out["tokens"] = len(samples) * (max(len(s["input_ids"]) for s in samples) - 1)
    return out


def chunk_rank(rank: int, payload: bytes) -> bytes:
    """``payload``: (strategy, cases, chunk sizes); per case one step per chunk size, same weights."""
    strategy, cases, chunks = loads(payload)
    return dumps([[one_step(strategy, case, rank, c) for c in chunks] for case in cases])
