"""Batches: ObjectRefs only, deterministic per seed, resumable, DP-disjoint, mixed by weight."""

from __future__ import annotations

from collections import Counter
from itertools import islice
from pathlib import Path

import pytest
import ray
import test_data_fakes
from test_data_fakes import caption_sample, families, make_tokenizer_dir, write_image, write_jsonl

from disagg.config.schema import Config
from disagg.data import build_data_source
from disagg.runtime.routing import contiguous

ray.cloudpickle.register_pickle_by_value(test_data_fakes)  # Ray workers cannot import test modules
N = 8


@pytest.fixture(scope="module")
def root(tmp_path_factory, ray_local):
    root = tmp_path_factory.mktemp("src")
    make_tokenizer_dir(root)
    write_image(root / "img" / "a.png", 8, 8)
    write_jsonl(root / "a.jsonl", [caption_sample("img/a.png", f"A red square {i}.") for i in range(N)])
    write_jsonl(
        root / "b.jsonl",
        [
            {
                "conversations": [
                    {"from": "human", "value": "Answer briefly."},
                    {"from": "gpt", "value": f"A tone {i}."},
                ]
            }
            for i in range(4)
        ],
    )
    return root


def config(root: Path, train, seed: int = 0, **data) -> Config:
    return Config(
        model={
            "vision": {"family": "fake_image", "path": str(root / "tok")},
            "llm": {"family": "fake_lm", "path": str(root / "tok")},
        },
        data={"train": train, "media_root": str(root), "batch_size": 4, **data},
        train={"seed": seed},
    )


def ids(batches, steps: int) -> list[list[int]]:
    return [[s.index for s in b] for b in islice(batches, steps)]


@pytest.fixture(scope="module")
def src(root):
    return build_data_source(config(root, str(root / "a.jsonl")), families(root / "tok"))


def test_refs_and_metadata(src, root):
    batch = next(src.batches())
    assert len(batch) == 4
    assert src.stats() == {"samples": N, "skipped": 0, "dropped_too_long": 0, "truncated": 0}
    s = batch[0]
    # the driver holds ObjectRefs and ints only; tensors live in the object store
    assert set(s.inputs) == {"vision", "llm"}
    assert all(isinstance(r, ray.ObjectRef) for r in s.inputs.values())
    llm = ray.get(s.inputs["llm"])
    vision = ray.get(s.inputs["vision"])
    assert s.num_tokens == len(llm["input_ids"]) and s.num_label_tokens == int(
        (llm["labels"][1:] != -100).sum()
    )
    assert s.num_media_tokens == {"vision": 4} and vision["grid"].tolist() == [[2, 2]]
    assert s.source == f"{root / 'a.jsonl'}:{s.index + 1}"
    assert f"square {s.index}." in test_data_fakes.FakeLMFamily(root / "tok").tokenizer().decode(
        llm["input_ids"]
    )


def test_same_seed_same_order_and_epochs_reshuffled(src, root):
    again = build_data_source(config(root, str(root / "a.jsonl")), families(root / "tok"))
    first = ids(src.batches(), 6)
    assert first == ids(again.batches(), 6)
    # every epoch (2 steps of 4) is a permutation of all samples, and epochs differ
    epochs = [sorted(first[2 * e] + first[2 * e + 1]) for e in range(3)]
    assert all(e == list(range(N)) for e in epochs)
    assert len({tuple(first[2 * e] + first[2 * e + 1]) for e in range(3)}) > 1
    other = build_data_source(config(root, str(root / "a.jsonl"), seed=1), families(root / "tok"))
    assert ids(other.batches(), 6) != first


def test_resume_at_step(src):
    full = ids(src.batches(), 7)
    assert ids(src.batches(start_step=3), 4) == full[3:]


def test_no_shuffle_is_file_order(root):
    plain = build_data_source(config(root, str(root / "a.jsonl"), shuffle=False), families(root / "tok"))
    assert ids(plain.batches(), 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


def test_two_dp_replicas_see_disjoint_samples(src):
    seen: list[list[int]] = [[], []]
    for batch in islice(src.batches(), 2):  # one epoch
        for replica, positions in enumerate(contiguous([1] * len(batch), 2)):
            seen[replica] += [batch[p].index for p in positions]
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(N))
    assert len(seen[0]) == len(seen[1]) == N // 2


def test_mixed_datasets_follow_weights(root):
    train = [{"path": str(root / "a.jsonl"), "weight": 3.0}, {"path": str(root / "b.jsonl"), "weight": 1.0}]
    mixed = build_data_source(config(root, train), families(root / "tok"))
    assert mixed.stats()["samples"] == N + 4
    drawn = [s for b in islice(mixed.batches(), 100) for s in b]
    per_file = Counter(s.source.rsplit(":", 1)[0] for s in drawn)
    share = per_file[str(root / "a.jsonl")] / len(drawn)
    assert 0.7 < share < 0.8  # 3:1 weights
    text_only = next(s for s in drawn if "b.jsonl" in s.source)
    assert set(text_only.inputs) == {"llm"} and text_only.num_media_tokens == {}
    # indices are unique across datasets
    assert len({s.index for s in mixed.samples()}) == N + 4
