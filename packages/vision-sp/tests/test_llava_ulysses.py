"""``ulysses`` on a LLaVA (SigLIP or CLIP + MLP projector) encoder equals the single-process HF encoder.

The CLIP tower (llava-1.5) attends over a CLS token per image that the LLM
never receives: a shard may hold CLS rows, which no sample takes."""

from __future__ import annotations

import pytest
from ulysses_cases import assert_ulysses_matches, tower_case

from disagg_vision_sp.families.llava import LlavaVision

# Raw sizes differ; the processor resizes all to 30x30 -> 25 tokens per image (odd).
SAMPLES = [[(50, 40), (20, 30)], [(64, 64)], [(31, 17)], [(40, 90), (33, 33)]]


@pytest.fixture(scope="module", params=["siglip", "clip"])
def case(request):
    family = LlavaVision(
        request.getfixturevalue("tiny_llava" if request.param == "siglip" else "tiny_llava_clip")
    )
    return tower_case(family, SAMPLES)


def test_encode_is_hf_get_image_features(case):
    import torch
    from transformers import LlavaForConditionalGeneration

    family, inputs, _, outs, _ = case
    hf = LlavaForConditionalGeneration.from_pretrained(family.path)
    cfg = hf.config
    for x, out in zip(inputs, outs):
        feats = hf.model.get_image_features(
            x["pixel_values"],
            vision_feature_layer=cfg.vision_feature_layer,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        ).pooler_output
        assert torch.equal(torch.cat(list(feats)).detach(), out)
    assert [family.num_tokens(x) for x in inputs] == [[25, 25], [25], [25], [25, 25]]


# CLIP at degree 2 already puts both images of sample 0 (and their CLS rows) on shard 0;
# the other meshes run on SigLIP only, to keep the suite short.
@pytest.mark.parametrize(
    "case,degree,replicas",
    [("siglip", 2, 1), ("siglip", 4, 1), ("siglip", 2, 2), ("clip", 2, 1)],
    indirect=["case"],
)
def test_ulysses_matches_hf(case, degree, replicas):
    family, inputs, *_ = case
    assert_ulysses_matches(case, degree, replicas)
