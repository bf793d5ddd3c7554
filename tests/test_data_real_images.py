"""Real photographs (scikit-learn's sample images) through the pipeline and the
``qwen2_5_vl`` vision family's preprocessing, with min_pixels/max_pixels resizing."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import ray
import torch

from disagg.config.schema import Config
from disagg.plugins import get_registry

reg = get_registry()
pytestmark = pytest.mark.skipif(
    ("encoder", "qwen2_5_vl") not in reg.families or ("llm", "qwen2_5_vl") not in reg.families,
    reason="needs the qwen2_5_vl families of disagg-vision-sp and disagg-llm-tp",
)


@pytest.fixture(scope="module")
def photos(tmp_path_factory, ray_local):
    from PIL import Image
    from sklearn.datasets import load_sample_images

    root = tmp_path_factory.mktemp("photos")
    data = load_sample_images()
    names = []
    for path, array in zip(data.filenames, data.images):
        name = Path(path).name
        Image.fromarray(array).save(root / name, quality=95)
        names.append(name)
    rows = [
        {
            "image": names[0],
            "conversations": [
                {"from": "human", "value": "<image>\nDescribe the image."},
                {"from": "gpt", "value": "A temple."},
            ],
        },
        {
            "image": names,
            "conversations": [
                {"from": "human", "value": "<image> and <image>: which is a flower?"},
                {"from": "gpt", "value": "The second."},
            ],
        },
    ]
    (root / "photos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, names


def tiny_dir(tmp_path: Path, min_pixels: int, max_pixels: int) -> Path:
    vlm = reg.family("encoder", "qwen2_5_vl").make_tiny(tmp_path / "vlm")
    cfg_path = Path(vlm) / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(min_pixels=min_pixels, max_pixels=max_pixels)
    if isinstance(cfg.get("size"), dict):
        cfg["size"] = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return Path(vlm)


@pytest.mark.parametrize("max_side", [64, 128])
def test_photos_resized_within_pixel_budget(photos, tmp_path: Path, max_side: int):
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor

    from disagg.data import build_data_source

    root, names = photos
    vlm = tiny_dir(tmp_path, min_pixels=32 * 32, max_pixels=max_side * max_side)
    fams = {"vision": reg.family("encoder", "qwen2_5_vl")(vlm), "llm": reg.family("llm", "qwen2_5_vl")(vlm)}
    cfg = Config(
        model={
            "vision": {"family": "qwen2_5_vl", "path": str(vlm)},
            "llm": {"family": "qwen2_5_vl", "path": str(vlm)},
        },
        data={
            "train": str(root / "photos.jsonl"),
            "media_root": str(root),
            "batch_size": 2,
            "shuffle": False,
        },
    )
    src = build_data_source(cfg, fams)
    assert src.stats() == {"samples": 2, "skipped": 0, "dropped_too_long": 0, "truncated": 0}
    one, two = src.samples()
    vcfg = AutoConfig.from_pretrained(vlm).vision_config
    patch, merge = vcfg.patch_size, vcfg.spatial_merge_size

    vision = ray.get(two.inputs["vision"])
    grid = vision["image_grid_thw"]
    assert grid.shape == (2, 3)
    for (t, h, w), name in zip(grid.tolist(), names):
        orig = Image.open(root / name)
        pixels = h * w * patch * patch
        # smart resize: within [min_pixels, max_pixels], sides multiples of patch*merge, aspect kept
        assert 32 * 32 <= pixels <= max_side * max_side
        assert h % merge == 0 and w % merge == 0 and t == 1
        assert math.isclose((w / h), orig.width / orig.height, rel_tol=0.25)
    assert (
        max(grid[:, 1:].prod(1).tolist()) * patch * patch > (max_side * max_side) // 4
    )  # really used the budget

    # identical to Hugging Face's own processor on the same photos
    ref = AutoImageProcessor.from_pretrained(vlm)(
        images=[Image.open(root / n).convert("RGB") for n in names], return_tensors="pt"
    )
    torch.testing.assert_close(vision["pixel_values"], ref["pixel_values"].float(), rtol=1e-5, atol=1e-6)
    assert torch.equal(grid, ref["image_grid_thw"])

    # placeholders expanded to exactly the tokens each photo becomes, in order, and mRoPE gets the grids
    llm = ray.get(two.inputs["llm"])
    per_image = (grid.prod(1) // merge**2).tolist()
    assert two.num_media_tokens == {"vision": sum(per_image)}
    image_id = AutoConfig.from_pretrained(vlm).image_token_id
    assert int((llm["input_ids"] == image_id).sum()) == sum(per_image)
    assert torch.equal(llm["image_grid_thw"], grid)
    assert one.num_media_tokens == {"vision": per_image[0]}


def test_pixel_budget_changes_tokens(photos, tmp_path: Path):
    """A larger max_pixels gives more vision tokens for the same photo."""
    root, names = photos
    counts = []
    for side in (64, 128):
        vlm = tiny_dir(tmp_path / str(side), 32 * 32, side * side)
        fam = reg.family("encoder", "qwen2_5_vl")(vlm)
        from disagg.data.media import load_image

        counts.append(fam.num_tokens(fam.preprocess([load_image(str(root / names[1]))]))[0])
    assert counts[1] > 2 * counts[0]
    shutil.rmtree(tmp_path, ignore_errors=True)
