"""megatron_tp equals the single-process Hugging Face model: loss, logits,
input-embedding gradients, every (merged) parameter gradient at step 1, and
every parameter after three clipped AdamW steps, by the project's tolerance policy
(``disagg.testing.tolerance``: per element against each tensor's own scale; parameters in units
of the learning rate, the gradient bound carried through AdamW per element)."""

from __future__ import annotations

import pytest
import torch
from tp_cases import LR, Case, family_cls, make_batch, reference, run_tp_many

from disagg.testing.tolerance import (
    assert_params_close,
    assert_scalar_close,
    assert_tensor_close,
    assert_tensors_close,
)

CASES = [
    # name, dir key, family, degree, replicas, sequence_parallel
    ("qwen2-tied-d2", "qwen2", "qwen2", 2, 1, False),
    ("qwen2-tied-d4-kv-replicated", "qwen2", "qwen2", 4, 1, False),
    ("qwen2-untied-d2-r2", "qwen2_untied", "qwen2", 2, 2, False),
    ("llama-d2", "llama", "llama", 2, 1, False),
    ("llama-d4-kv-replicated", "llama", "llama", 4, 1, False),
    ("qwen2_5_vl-mrope-d2", "qwen2_5_vl", "qwen2_5_vl", 2, 1, False),
    ("qwen2_vl-mrope-d2", "qwen2_vl", "qwen2_vl", 2, 1, False),
    # DeepStack: 1 feature block beside each image row, added after layer 0; 2 replicas
    ("qwen3_vl-deepstack-d2-r2", "qwen3_vl", "qwen3_vl", 2, 2, False),
    # Megatron sequence parallelism; with 3 samples (2 over 2 replicas) the token
    # counts (45; 7 and 14) are not multiples of the degree, so shards are padded.
    ("qwen2-tied-d4-kv-replicated-sp", "qwen2", "qwen2", 4, 1, True),
    ("qwen2-untied-d2-r2-sp", "qwen2_untied", "qwen2", 2, 2, True),
    ("llama-d2-sp", "llama", "llama", 2, 1, True),
    ("qwen2_5_vl-mrope-d2-sp", "qwen2_5_vl", "qwen2_5_vl", 2, 1, True),
]


@pytest.fixture(scope="module")
def runs(tiny_dirs) -> dict[str, tuple[Case, list[dict]]]:
    """Every case's megatron_tp run; the cases of one world size share one spawn of ranks."""
    cases = {}
    for name, key, family, degree, replicas, sp in CASES:
        fam = family_cls(family)(tiny_dirs[key])
        samples, embeds = make_batch(fam, n_samples=(2 if replicas > 1 else 3) if sp else 4)
        cases[name] = Case(family, tiny_dirs[key], degree, replicas, 3, sp, samples=samples, embeds=embeds)
    outs = run_tp_many(cases)
    return {name: (cases[name], outs[name]) for name in cases}


@pytest.mark.parametrize(
    "name,degree,replicas,sp", [(c[0], *c[3:]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_matches_hf(runs, name, degree, replicas, sp):
    case, outs = runs[name]
    ref = reference(case)
    first = outs[0]
    heads = [outs[r * degree] for r in range(replicas)]  # shard 0 of each replica

    assert_scalar_close(sum(o["loss"] for o in heads), ref["loss"], "loss")
    assert_tensor_close(torch.cat([o["logits"] for o in heads]), ref["logits"], "logits")

    # Encoder gradients come back complete from shard 0 of each replica.
    got = [g for o in heads for g in o["embed_grads"]]
    assert len(got) == len(ref["embed_grads"])
    for i, (g, r) in enumerate(zip(got, ref["embed_grads"])):
        assert_tensors_close(g, r, f"sample {i} input-embedding gradient ")

    ref_norm_sq = sum(float(g.double().pow(2).sum()) for g in ref["grads"].values())
    for o in outs:
        assert_scalar_close(o["norm_sq"], ref_norm_sq, f"rank {o['rank']} grad_norm_sq")

    assert_tensors_close(first["grads"], ref["grads"], "gradient of ")
    steps, grads = case.steps, ref["param_grads"]
    assert_params_close(
        first["params"], ref["params"], lr=LR, steps=steps, grads=grads, what=f"after {steps} steps: "
    )
    assert first["comm_bytes"] > 0
    if sp:  # the regions really were split: sequence-parallel collectives ran
        assert first["collectives"].get("reduce_scatter", 0) > 0 and first["collectives"]["all_gather"] > 0
