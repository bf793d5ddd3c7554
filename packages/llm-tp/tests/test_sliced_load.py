"""Sharded build and load (issue 26 item 1): under ``megatron_tp`` each rank builds its
module on the meta device, parallelizes it and reads only its own slices of the
checkpoint's safetensors; the result is bit for bit today's whole-module load cut in
memory, and no rank reads more than its share (every element of a split tensor is
read by exactly the ranks that hold it; a spy on the reads counts their bytes).

Families: qwen2 (tied embeddings, vocabulary 498 padded), llama (untied, 391 padded),
qwen2_5_vl (the LLM of a whole VLM dir, tower dropped unbuilt) and qwen3_vl (per-head
q/k norms), degree 2, in one spawn. The encoder towers: tests/test_sliced_load_towers.py."""

from __future__ import annotations

from tp_cases import family_cls

from disagg_llm_tp.testing import check_sliced_load

FAMILIES = ("qwen2", "llama", "qwen2_5_vl", "qwen3_vl")


def test_sliced_load_equals_whole_and_reads_only_own_slices(tiny_dirs):
    cases = [("llm", family_cls(name)(tiny_dirs[name])) for name in FAMILIES]
    # q/k/v/o, gate/up/down, embeddings
    check_sliced_load(cases, degree=2, min_split=7)
