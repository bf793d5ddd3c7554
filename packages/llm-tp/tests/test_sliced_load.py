"""Sharded build and load (issue 26 item 1): under ``megatron_tp`` each rank builds its
module on the meta device, parallelizes it and reads only its own slices of the
checkpoint's safetensors; the result is bit for bit today's whole-module load cut in
memory, and no rank reads more than its share (every element of a split tensor is
read by exactly the ranks that hold it; a spy on the reads counts their bytes).

Families: qwen2 (tied embeddings, vocabulary 498 padded), llama (untied, 391 padded),
qwen2_5_vl (the LLM of a whole VLM dir, tower dropped unbuilt) and qwen3_vl (per-head
q/k norms), degree 2, in one spawn."""

from __future__ import annotations

from sliced_cases import sliced_rank

from disagg.interfaces.hf import StoredTensors
from disagg.testing.dist import run_ranks
from disagg.testing.ranks import dumps, loads
from disagg.testing.tolerance import assert_exact

FAMILIES = ("qwen2", "llama", "qwen2_5_vl", "qwen3_vl")


def test_sliced_load_equals_whole_and_reads_only_own_slices(tiny_dirs):
    degree = 2
    cases = [(name, tiny_dirs[name]) for name in FAMILIES]
    ranks = [loads(b) for b in run_ranks(sliced_rank, degree, dumps(cases))]
    for i, (name, path) in enumerate(cases):
        stored = StoredTensors(path)
        per_rank = [r[i] for r in ranks]
        read_by_key: dict[str, list[int]] = {}
        for rank, got in enumerate(per_rank):
            assert not got["meta"], f"{name} rank {rank}: left on the meta device: {got['meta']}"
            assert_exact(got["sliced"], got["today"], f"{name} rank {rank}: ")
            for key, nbytes in got["reads"]:
                read_by_key.setdefault(key, [0] * degree)[rank] += nbytes
        specs = per_rank[0]["specs"]
        assert {key for key, _, _ in specs.values()} == set(read_by_key), name  # what the module holds
        for key, kind, share in specs.values():
            full = 4 * _numel(stored.shape(key))  # fp32 on disk
            got = read_by_key[key]
            if kind == "replicated":
                assert got == [full] * degree, f"{name}: {key} is replicated: each rank reads it whole"
            else:
                # each rank its own piece only; together every element, once per copy
                assert all(b < full for b in got), f"{name}: {key} ({kind}) read {got} of {full} bytes"
                assert sum(got) == full * share, f"{name}: {key} ({kind}) read {got} of {full} bytes"
        split = sum(1 for _, kind, _ in specs.values() if kind != "replicated")
        assert split >= 7, f"{name}: only {split} split tensors"  # q/k/v/o, gate/up/down, embeddings


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
