"""Test kit for the sharded build and load (issue 26 item 1): under ``megatron_tp`` a rank
builds its module on the meta device, parallelizes it and reads only its own slices of the
checkpoint (:mod:`disagg_llm_tp.load`). :func:`check_sliced_load` runs that beside the
whole build sliced in memory on ``degree`` gloo ranks and asserts that they are equal bit
for bit and that no rank reads more than its share; any family with a layer map and a
``build_empty`` (LLM, vision tower, audio encoder) can be checked with it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from disagg.interfaces import Family
from disagg.testing.dist import run_ranks
from disagg.testing.ranks import dumps, loads, rank_context, strategy_rank
from disagg.testing.tolerance import assert_exact

__all__ = ["check_sliced_load", "sliced_rank"]


def check_sliced_load(cases: list[tuple[str, Family]], degree: int = 2, min_split: int = 1) -> None:
    """For each ``(module name, family)``: every rank's sliced build equals the whole build
    cut by the strategy (values, and which parameters train), nothing stays on the meta
    device, a replicated tensor is read whole by each rank, a split one only in part, every
    element once per copy; and at least ``min_split`` stored tensors are split (the family's
    layer map is really applied)."""
    ranks = [loads(b) for b in run_ranks(sliced_rank, degree, dumps(cases))]
    for i, (module, family) in enumerate(cases):
        name = f"{module} family {family.name!r} ({family.path})"
        stored = family.stored_tensors()  # the dir's tensors and any the family draws
        per_rank = [r[i] for r in ranks]
        read_by_key: dict[str, list[int]] = {}
        for rank, got in enumerate(per_rank):
            assert not got["meta"], f"{name} rank {rank}: left on the meta device: {got['meta']}"
            assert_exact(got["sliced"], got["whole"], f"{name} rank {rank}: ")
            assert got["frozen"] == got["whole_frozen"], f"{name} rank {rank}: frozen parameters differ"
            for key, nbytes in got["reads"]:
                read_by_key.setdefault(key, [0] * degree)[rank] += nbytes
        specs = per_rank[0]["specs"]
        assert {key for key, _, _ in specs.values()} == set(read_by_key), name  # what the module holds
        for key, kind, share in specs.values():
            full = 4 * torch.Size(stored.shape(key)).numel()  # fp32 on disk
            got = read_by_key[key]
            if kind == "replicated":
                assert got == [full] * degree, f"{name}: {key} is replicated: each rank reads it whole"
            else:
                # each rank its own piece only; together every element, once per copy
                assert all(b < full for b in got), f"{name}: {key} ({kind}) read {got} of {full} bytes"
                assert sum(got) == full * share, f"{name}: {key} ({kind}) read {got} of {full} bytes"
        split = sum(1 for _, kind, _ in specs.values() if kind != "replicated")
        assert split >= min_split, f"{name}: only {split} split tensors"


def sliced_rank(rank: int, payload: bytes) -> bytes:
    """One rank of :func:`check_sliced_load` (spawned ranks import it by name): the strategy's
    own build (empty, then its slices read; a whole build fails) beside the family's whole
    build handed to the same strategy, and every stored read with the bytes it returned."""
    from disagg_llm_tp.strategy import MegatronTPStrategy

    world = dist.get_world_size()
    out = []
    for module, fam in loads(payload):
        ref = copy.deepcopy(fam)
        ctx = rank_context(module, rank, world, 1)
        reads: list[tuple[str, int]] = []
        source = type(fam.stored_tensors())  # StoredTensors, or the family's own (drawn parts)
        original = source.read

        def spy(self, key, index=(), dtype=None, device="cpu", original=original, reads=reads):  # type: ignore[no-untyped-def]
            t = original(self, key, index, dtype, device)
            reads.append((key, t.numel() * t.element_size()))
            return t

        def whole(*_a: Any, **_k: Any) -> None:
            raise AssertionError("the sliced path built the whole module")

        source.read, fam.build = spy, whole  # type: ignore[method-assign]
        try:
            sliced = strategy_rank(MegatronTPStrategy, fam, ctx)
        finally:
            source.read = original  # type: ignore[method-assign]
        cut = strategy_rank(MegatronTPStrategy, ref, ctx, module=ref.build(torch.float32))
        specs = {
            n: (fam.checkpoint_name(n), p.tp_spec.kind, p.tp_spec.kv_share)
            for n, p in sliced.module.named_parameters()
        }
        out.append(
            {
                "sliced": _tensors(sliced.module),
                "whole": _tensors(cut.module),
                "meta": [n for n, t in _tensors(sliced.module, clone=False).items() if t.is_meta],
                "frozen": [n for n, p in sliced.module.named_parameters() if not p.requires_grad],
                "whole_frozen": [n for n, p in cut.module.named_parameters() if not p.requires_grad],
                "reads": reads,
                "specs": specs,
            }
        )
    return dumps(out)


def _tensors(module: torch.nn.Module, clone: bool = True) -> dict[str, torch.Tensor]:
    # parameters and every buffer (rotary frequencies, computed, not loaded)
    named = [*module.named_parameters(), *module.named_buffers()]
    return {n: t.detach().clone() if clone else t for n, t in named}
