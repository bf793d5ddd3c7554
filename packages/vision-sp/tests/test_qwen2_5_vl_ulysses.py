"""``ulysses`` on the Qwen2.5-VL vision tower equals the single-process HF encoder."""

from __future__ import annotations

import pytest

from disagg.testing.tolerance import assert_scalar_close
from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision
from disagg_vision_sp.testing import (
    assemble,
    assert_close,
    assert_grads_close,
    random_images,
    reference,
    run_ulysses,
    upstream_grads,
)

# (width, height) per image, per sample: 24, 4, 15 (odd), 40 and 16 output rows; the 16x16
# image is one window, so at degree 2 and 4 some rank holds none of it.
SAMPLES = [[(48, 32), (16, 16)], [(40, 24)], [(16, 16)], [(64, 40), (32, 32)]]


@pytest.fixture(scope="module")
def case(tiny_qwen):
    family = Qwen2_5_VLVision(tiny_qwen)
    inputs = [family.preprocess(random_images(s, seed=i)) for i, s in enumerate(SAMPLES)]
    grads = upstream_grads(family, inputs)
    outs, pgrads = reference(family, inputs, grads)
    return family, inputs, grads, outs, pgrads


def test_ragged_batch_shapes(case):
    family, inputs, *_ = case
    counts = [family.num_tokens(x) for x in inputs]
    assert counts == [[24, 4], [15], [4], [40, 16]]


@pytest.mark.parametrize("degree,replicas", [(2, 1), (4, 1), (2, 2)])
def test_ulysses_matches_hf(case, degree, replicas):
    family, inputs, grads, ref_outs, ref_grads = case
    results = run_ulysses(degree, replicas, family, inputs, grads)
    outs = assemble(results, len(inputs), family.hidden_size())
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert_close(o, r, f"sample {i} output")
    assert_grads_close(results[0]["grads"], ref_grads)
    # every rank reports the same group norm, the single-process one
    ref_norm = sum(float(g.double().pow(2).sum()) for g in ref_grads.values())
    for res in results:
        assert_scalar_close(res["grad_norm_sq"], ref_norm, "grad_norm_sq")
    # some rank held an empty shard of some sample and still took part
    assert any(len(pos) == 0 for res in results for pos, _, _ in res["shards"])
