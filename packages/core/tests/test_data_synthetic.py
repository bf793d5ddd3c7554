"""``make-tiny --large N``: a big dataset of distinct samples over the few demo images."""

from __future__ import annotations

import json
from pathlib import Path

from disagg.cli.make_tiny import make_tiny
from disagg.data.index import index_dataset
from disagg.data.records import parse_sample


def test_large_dataset_reuses_demo_images(tmp_path):
    manifest = make_tiny(tmp_path, [], train_per_class=1, eval_per_class=1, image_size=16, large=5000)
    large, root = Path(manifest["data"]["large"]), Path(manifest["media_root"])
    ix = index_dataset(large, root)
    assert ix.size == 5000
    rows = [json.loads(line) for line in large.read_text().splitlines()]
    train = large.with_name("train.jsonl").read_text().splitlines()
    assert len({r["image"] for r in rows}) == len(train)  # only the demo images
    assert len({json.dumps(r) for r in rows}) == 5000  # but every sample distinct
    for i in (0, 1234, 4999):
        messages, media = parse_sample(rows[i], f"large.jsonl:{i + 1}", root, {"image"})
        assert media["image"][0].startswith(str(root.resolve())) and messages[-1][0] == "assistant"
