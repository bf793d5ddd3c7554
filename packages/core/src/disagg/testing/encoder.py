"""Encoder equivalence: any strategy's ranks vs the single-process encoder.

The reference and the ranks see the same samples and the same upstream
gradient (a fixed random tensor over each sample's full output). Replica ``r``
encodes samples ``r::replicas``, backwards its shards' rows, reduces; the
shards are then assembled (every row exactly once) and compared with the
reference's outputs, the merged gradients with its parameter gradients (a
parameter without a reference gradient must stay absent, never zero-filled),
and every rank's squared grad norm with the reference's, by the project's
tolerance policy (``disagg.testing.tolerance``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from disagg.interfaces import EncoderFamily
from disagg.kit import Strategy
from disagg.testing import ranks
from disagg.testing.tolerance import assert_scalar_close, assert_tensor_close, assert_tensors_close


def upstream_grads(
    family: EncoderFamily, inputs: list[dict[str, torch.Tensor]], seed: int = 1
) -> list[torch.Tensor]:
    """The fixed 'gradient from the LLM' of each sample's full embedding."""
    g = torch.Generator().manual_seed(seed)
    hidden = family.hidden_size()
    return [torch.randn(sum(family.num_tokens(x)), hidden, generator=g) for x in inputs]


def encoder_reference(
    family: EncoderFamily, inputs: list[dict[str, torch.Tensor]], grads: list[torch.Tensor]
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The family's unpartitioned forward of every sample in one process, backward from
    ``grads``; parameters that get no gradient are absent, not zero."""
    module = family.build(torch.float32)
    outs = [family.encode(module, x) for x in inputs]
    torch.autograd.backward(outs, grads)
    pgrads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    return [o.detach() for o in outs], pgrads


@dataclass
class EncoderCase:
    """One family's samples for :func:`run_encoder` (several share one spawn of the ranks)."""

    family: EncoderFamily
    inputs: list[dict[str, torch.Tensor]]
    grads: list[torch.Tensor]
    #: put the module in train mode after set-up, as core's worker does
    train: bool = False
    options: dict[str, Any] = field(default_factory=dict)


def encoder_rank(
    rank: int, strategy: type[Strategy], degree: int, replicas: int, packed: list[tuple]
) -> bytes:
    """One rank (under ``disagg.testing.dist.run_ranks``), every case in turn: its shards,
    its all-to-all bytes, the group's squared norm and the merged gradients (rank 0 keeps them)."""
    results = []
    for family_cls, path, family_options, inputs, grads, train, options in packed:
        family = family_cls(Path(path), family_options)
        ctx = ranks.rank_context(family_module(family), rank, degree, replicas)
        strat = ranks.strategy_rank(strategy, family, ctx, options=options, train=train)
        mine = list(range(ctx.replica, len(inputs), replicas))
        shards = ranks.encode_and_backward(strat, 0, [inputs[i] for i in mine], [grads[i] for i in mine])
        a2a = int(ctx.comm.bytes_by_op.get("all_to_all", 0))
        out: dict[str, Any] = {
            "samples": mine,
            "shards": [(s.positions, s.value.detach(), s.total) for s in shards],
            "all_to_all_bytes": a2a,
            "grad_norm_sq": ranks.reduce(strat),
        }
        grads_full = ranks.full_grads(strat)  # collective: every rank
        if rank == 0:
            out["grads"] = grads_full
        results.append(out)
    return ranks.dumps(results)


def family_module(family: EncoderFamily) -> str:
    """The module name an encoder family's group has (``vision`` for images)."""
    return "vision" if family.modality == "image" else family.modality


def run_encoder(
    strategy: type[Strategy], degree: int, replicas: int, cases: list[EncoderCase]
) -> list[list[dict[str, Any]]]:
    """Per case, the results of every rank (by rank), from one spawn of ``degree * replicas`` ranks."""
    from disagg.testing.dist import run_ranks

    packed = [
        (type(c.family), str(c.family.path), c.family.options, c.inputs, c.grads, c.train, c.options)
        for c in cases
    ]
    raw = run_ranks(encoder_rank, degree * replicas, strategy, degree, replicas, packed)
    per_rank = [ranks.loads(r) for r in raw]
    return [[rank_results[c] for rank_results in per_rank] for c in range(len(cases))]


def assemble(results: list[dict[str, Any]], n_samples: int, hidden: int) -> list[torch.Tensor]:
    """Each sample's full embedding from the shards of every rank (what the LLM does);
    every row must be covered exactly once."""
    full: list[torch.Tensor | None] = [None] * n_samples
    seen: list[torch.Tensor | None] = [None] * n_samples
    for res in results:
        for i, (pos, val, total) in zip(res["samples"], res["shards"]):
            if full[i] is None:
                full[i] = torch.full((total, hidden), float("nan"))
                seen[i] = torch.zeros(total, dtype=torch.long)
            full[i][pos] = val  # type: ignore[index]
            seen[i][pos] += 1  # type: ignore[index]
    for i, s in enumerate(seen):
        if s is None or not bool((s == 1).all()):
            raise AssertionError(f"sample {i}: rows not covered exactly once by the shards")
    return [f for f in full]  # type: ignore[misc]


def assert_encoder_matches(
    results: list[dict[str, Any]],
    ref_outs: list[torch.Tensor],
    ref_grads: dict[str, torch.Tensor],
    hidden: int,
) -> None:
    """Outputs and gradients per element against each tensor's own scale, every rank's
    squared grad norm relative to its size; a gradient the reference lacks must be absent."""
    outs = assemble(results, len(ref_outs), hidden)
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert_tensor_close(o, r, f"sample {i} output")
    assert_tensors_close(results[0]["grads"], ref_grads, "grad ")
    ref_norm = sum(float(g.double().pow(2).sum()) for g in ref_grads.values())
    for res in results:
        assert_scalar_close(res["grad_norm_sq"], ref_norm, "squared grad norm")
