"""``ulysses`` on the Qwen2.5-VL vision tower equals the single-process HF encoder."""

from __future__ import annotations

import pytest
from ulysses_cases import assert_ulysses_matches, tower_case

from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision

# (width, height) per image, per sample: 24, 4, 15 (odd), 40 and 16 output rows; the 16x16
# image is one window, so at degree 2 and 4 some rank holds none of it.
SAMPLES = [[(48, 32), (16, 16)], [(40, 24)], [(16, 16)], [(64, 40), (32, 32)]]


@pytest.fixture(scope="module")
def case(tiny_qwen):
    return tower_case(Qwen2_5_VLVision(tiny_qwen), SAMPLES)


def test_ragged_batch_shapes(case):
    family, inputs, *_ = case
    counts = [family.num_tokens(x) for x in inputs]
    assert counts == [[24, 4], [15], [4], [40, 16]]


@pytest.mark.parametrize("degree,replicas", [(2, 1), (4, 1), (2, 2)])
def test_ulysses_matches_hf(case, degree, replicas):
    results = assert_ulysses_matches(case, degree, replicas)
    # some rank held an empty shard of some sample and still took part
    assert any(len(pos) == 0 for res in results for pos, _, _ in res["shards"])
