"""The feature cache's key and index without Ray: every part of the key separates entries
(a change of any one misses), the digests follow the bytes, and the disk index evicts the
least recently used entries past its limit."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import torch

from disagg.data.digest import inputs_digest
from disagg.runtime.feature_cache import FeatureCache, read_part, write_part
from disagg.runtime.feature_key import RunKey, state_digest

BASE = RunKey("vision", "qwen2_5_vl", "fp32", {"max_pixels": 784, "processor": "ab"}, ("w0", "w1"))


def test_every_part_of_the_key_separates_entries():
    changed = [
        replace(BASE, module="audio"),
        replace(BASE, family="llava"),
        replace(BASE, precision="bf16"),
        replace(BASE, preprocessing={"max_pixels": 1568, "processor": "ab"}),
        replace(BASE, preprocessing={"max_pixels": 784, "processor": "cd"}),
        replace(BASE, weights=("w0", "w2")),
    ]
    keys = {BASE.key("m")} | {k.key("m") for k in changed} | {BASE.key("n")}
    assert len(keys) == len(changed) + 2
    assert BASE.key("m") == replace(BASE).key("m")  # and the same parts give the same key


def test_digests_follow_the_bytes():
    x = {"pixel_values": torch.arange(12.0).reshape(3, 4), "image_grid_thw": torch.tensor([[1, 1, 3]])}
    same = {k: v.clone() for k, v in reversed(x.items())}
    assert inputs_digest(x) == inputs_digest(same)
    nudged = dict(x, pixel_values=x["pixel_values"] + torch.eye(3, 4) * 1e-6)
    assert inputs_digest(nudged) != inputs_digest(x)
    assert inputs_digest(dict(x, pixel_values=x["pixel_values"].double())) != inputs_digest(x)
    m = torch.nn.Linear(3, 2)
    before = state_digest(m)
    with torch.no_grad():
        m.weight[0, 0] += 1e-6
    assert state_digest(m) != before


def _entry(d, key: str, nbytes: int, mtime: float) -> None:
    part = (torch.arange(2), torch.ones(2, 3), 2)
    f = d / key[:2] / f"{key}.r0.pt"
    write_part(str(f), part)
    manifest = d / key[:2] / f"{key}.json"
    manifest.write_text(json.dumps({"files": [f.name], "bytes": nbytes}))
    os.utime(manifest, (mtime, mtime))


def test_disk_index_is_reread_and_evicts_least_recently_used(tmp_path):
    for k, key in enumerate(["aa01", "bb02", "cc03"]):
        _entry(tmp_path, key, 100, 1000.0 + k)
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dd04.json").write_text("{torn")  # never an entry
    cache = FeatureCache("vision", "disk", 250, "qwen2_5_vl", "fp32", {}, tmp_path)
    [part] = cache.lookup("aa01")  # the oldest, used now: the next oldest goes first
    positions, value, total = read_part(part)
    assert torch.equal(value, torch.ones(2, 3)) and total == 2 and positions.tolist() == [0, 1]
    counts = cache.settle()
    assert (counts.hits, counts.misses, counts.bytes, counts.entries) == (1, 0, 200, 2)
    assert cache.lookup("bb02") is None and not (tmp_path / "bb" / "bb02.r0.pt").exists()
    assert cache.lookup("aa01") is not None and cache.lookup("dd04") is None
