"""Dropout under ulysses (tiny LLaVA tower, attention_dropout 0.25, eager attention).

Masks cannot equal the single-process encoder's by construction: HF draws one
mask for a batch of images over all heads from one stream; a ulysses rank holds
its tokens (outside attention) or its heads of the whole sequence (inside) and
draws their masks from its own (replica, shard) stream (drawn from the shared
default stream, two ranks' heads would be dropped together). So the tests check
reproducibility and statistics: the kept fraction, shards and replicas drawing
independently, and the expected output (sum_i <output_i, g_i>) against HF's.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from ulysses_cases import P, dropout_rank, dropout_spy, loads

from disagg.testing.dist import run_ranks
from disagg_vision_sp.families.llava import LlavaVision
from disagg_vision_sp.testing import random_images, upstream_grads

DRAWS = 6
SAMPLES = [[(50, 40), (20, 30)], [(64, 64)]]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = LlavaVision.make_tiny(tmp_path_factory.mktemp("dropout") / "llava")
    cfg = json.loads((path / "config.json").read_text())
    cfg["vision_config"]["attention_dropout"] = P
    (path / "config.json").write_text(json.dumps(cfg))
    family = LlavaVision(path, {"attn_implementation": "eager"})
    inputs = [family.preprocess(random_images(s, seed=i)) for i, s in enumerate(SAMPLES)]
    grads = upstream_grads(family, inputs)
    raw = run_ranks(dropout_rank, 4, 2, 2, str(path), inputs, grads, DRAWS)
    return family, inputs, grads, [loads(r) for r in raw]  # replica 0: ranks 0, 1; replica 1: 2, 3


def test_same_seed_is_reproducible(case):
    for res in case[3]:
        a, b = res["first"], res["again"]
        assert a["dot"] == b["dot"]
        assert all(torch.equal(x, y) for x, y in zip(a["masks"], b["masks"]))
        assert a["grads"].keys() == b["grads"].keys()
        assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])


def test_masks_kept_fraction_and_independence(case):
    results = case[3]
    for res in results:
        masks = res["first"]["masks"]
        # 2 tower layers run, each one batched attention call over the 3 images (one segment each;
        # the processor gives every image one size, so they share one length): a mask of batch 3
        assert len(masks) == 2 and all(m.shape[0] == 3 for m in masks), [m.shape for m in masks]
        kept = torch.cat([m[m >= 0].flatten() for m in masks]).double()
        sigma = math.sqrt(P * (1 - P) / kept.numel())
        assert abs(float(kept.mean()) - (1 - P)) <= 5 * sigma, float(kept.mean())
    # Same shapes everywhere and the same images in both replicas: only the streams differ.
    for a, b in ((0, 1), (2, 3), (0, 2), (1, 3)):
        for ma, mb in zip(results[a]["first"]["masks"], results[b]["first"]["masks"]):
            assert ma.shape == mb.shape and not torch.equal(ma, mb), (a, b)


def test_expected_output_matches_hf(case):
    """Mean of sum_i <output_i, g_i> over independent draws: ulysses (two
    replicas x DRAWS) and HF (as many seeds) agree within 4 standard errors."""
    family, inputs, grads, results = case
    ours = torch.tensor(
        [results[r]["dots"][i] + results[r + 1]["dots"][i] for r in (0, 2) for i in range(DRAWS)],
        dtype=torch.float64,
    )
    module = family.build(torch.float32)
    module.train()
    hf = []
    with torch.no_grad(), dropout_spy() as masks:
        for i in range(len(ours)):
            torch.manual_seed(1000 + i)
            hf.append(
                sum(
                    float((family.encode(module, x).double() * g.double()).sum())
                    for x, g in zip(inputs, grads)
                )
            )
    assert masks, "the reference must run its dropout"
    hf = torch.tensor(hf, dtype=torch.float64)
    assert float(ours.std()) > 0 and float(hf.std()) > 0, "dropout must change the output"
    se = math.sqrt(float(ours.var()) / len(ours) + float(hf.var()) / len(hf))
    assert abs(float(ours.mean() - hf.mean())) <= 4 * se, (ours.mean(), hf.mean(), se)
