"""A rank of the sliced-load test (spawned ranks import it by name): the strategy's
own build (empty, then its slices read) beside today's whole build sliced in memory."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tp_cases import family_cls

from disagg.interfaces.hf import StoredTensors
from disagg.testing.ranks import dumps, loads, rank_context, strategy_rank
from disagg_llm_tp.strategy import MegatronTPStrategy


def sliced_rank(rank: int, payload: bytes) -> bytes:
    world = dist.get_world_size()
    out = []
    for name, path in loads(payload):
        fam = family_cls(name)(path)
        ctx = rank_context("llm", rank, world, 1)
        reads: list[tuple[str, int]] = []
        original = StoredTensors.read

        def spy(self, key, index=(), dtype=None, device="cpu", original=original, reads=reads):
            t = original(self, key, index, dtype, device)  # every read, with the bytes it returned
            reads.append((key, t.numel() * t.element_size()))
            return t

        def whole(*_a, **_k):
            raise AssertionError("the sliced path built the whole module")

        StoredTensors.read, fam.build = spy, whole
        try:
            sliced = strategy_rank(MegatronTPStrategy, fam, ctx)
        finally:
            StoredTensors.read = original
        ref_fam = family_cls(name)(path)
        today = strategy_rank(MegatronTPStrategy, ref_fam, ctx, module=ref_fam.build(torch.float32))
        specs = {
            n: (fam.checkpoint_name(n), p.tp_spec.kind, p.tp_spec.kv_share)
            for n, p in sliced.module.named_parameters()
        }
        out.append(
            {
                "sliced": _tensors(sliced.module),
                "today": _tensors(today.module),
                "meta": [n for n, t in _tensors(sliced.module, clone=False).items() if t.is_meta],
                "reads": reads,
                "specs": specs,
            }
        )
    return dumps(out)


def _tensors(module: torch.nn.Module, clone: bool = True) -> dict[str, torch.Tensor]:
    # parameters and every buffer (rotary frequencies, computed, not loaded)
    named = [*module.named_parameters(), *module.named_buffers()]
    return {n: t.detach().clone() if clone else t for n, t in named}
