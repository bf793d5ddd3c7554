"""The streaming source: random access into the order, resume without re-preprocessing,
bad samples late in the stream, every batch full."""

from __future__ import annotations

import sys
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import ray
import test_data_fakes
from test_data_fakes import caption_sample, families, make_tokenizer_dir, write_image, write_jsonl

from disagg.config.schema import Config
from disagg.data import DataError, build_data_source
from disagg.data.index import index_dataset
from disagg.data.order import StreamOrder, sample_stream

ray.cloudpickle.register_pickle_by_value(test_data_fakes)  # Ray workers cannot import test modules
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # for Recorder
N = 40
BAD_LINE = 31  # a corrupt image late in the file


class Recorder:
    """``on_preprocess`` hook: the stream position of every sample a data worker starts on."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __call__(self, pos: int) -> None:
        with open(self.path, "a") as f:
            f.write(f"{pos}\n")

    def seen(self) -> list[int]:
        p = Path(self.path)
        return [int(x) for x in p.read_text().split()] if p.exists() else []


@pytest.fixture(scope="module")
def root(tmp_path_factory, ray_local):
    root = tmp_path_factory.mktemp("stream")
    make_tokenizer_dir(root)
    write_image(root / "a.png", 8, 8)
    (root / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 4)
    rows = [caption_sample("a.png", f"A red square {i}.") for i in range(N)]
    rows[BAD_LINE - 1] = caption_sample("corrupt.png", "Broken.")
    # a blank line is not a sample and does not shift the line numbers of the others
    write_jsonl(root / "a.jsonl", rows[:10] + [""] + rows[10:])
    return root


def config(root: Path, **data) -> Config:
    return Config(
        model={
            "vision": {"family": "fake_image", "path": str(root / "tok")},
            "llm": {"family": "fake_lm", "path": str(root / "tok")},
        },
        data={"train": str(root / "a.jsonl"), "media_root": str(root), "batch_size": 4, **data},
    )


def ids(batches, steps: int) -> list[list[int]]:
    return [[s.index for s in b] for b in islice(batches, steps)]


@pytest.mark.parametrize(
    "sizes,weights,shuffle", [([7], [1], True), ([7, 3], [3, 1], True), ([5, 0, 9], [1, 1, 2], False)]
)
def test_random_access_order_equals_the_sequential_stream(sizes, weights, shuffle):
    want = list(islice(sample_stream(sizes, weights, 5, shuffle), 9000))
    order = StreamOrder(sizes, weights, 5, shuffle)
    for start, n in [(0, 9000), (4090, 20), (8000, 1000), (3, 1)]:
        d, i = order.take(start, n)
        assert list(zip(d.tolist(), i.tolist())) == want[start : start + n]


def test_index_finds_lines_without_parsing(root):
    ix = index_dataset(root / "a.jsonl", root)
    assert ix.size == N
    # line numbers skip the blank line; every offset points at its line's JSON
    assert ix.lines[9] == 10 and ix.lines[10] == 12
    lines = (root / "a.jsonl").read_bytes()
    assert lines[ix.offsets[10] : ix.offsets[10] + ix.lengths[10]].startswith(b'{"image"')


def test_resume_from_state_skips_preprocessing_of_earlier_samples(root, tmp_path):
    cfg = config(root, on_error="skip", shuffle=False)
    full = build_data_source(cfg, families(root / "tok"))
    batches = full.batches()
    first = ids(batches, 8)
    state = full.state()  # after step 8: 32 stream entries, one of them skipped
    rest = ids(batches, 3)
    stats = {"samples": N, "skipped": 1, "dropped_too_long": 0, "truncated": 0}
    assert state == {"position": 33, "stats": stats}
    assert all(len(b) == 4 for b in first + rest), "a skipped sample is replaced: batches stay full"
    assert BAD_LINE - 1 not in {i for b in first for i in b}

    rec = Recorder(tmp_path / "seen.txt")
    resumed = build_data_source(cfg, families(root / "tok"), on_preprocess=rec)
    assert ids(resumed.batches(8, state=state), 3) == rest
    assert resumed.stats()["skipped"] == 1  # counters continue from the checkpoint
    seen = rec.seen()
    assert seen and min(seen) == 33, "nothing before the checkpointed position was preprocessed"


def test_shuffled_resume_equals_uninterrupted(root):
    cfg = config(root, on_error="skip")
    src = build_data_source(cfg, families(root / "tok"))
    it = src.batches()
    ids(it, 5)
    state = src.state()
    rest = ids(it, 6)  # crosses the epoch boundary (and the bad sample, wherever it fell)
    again = build_data_source(cfg, families(root / "tok"))
    assert ids(again.batches(5, state=state), 6) == rest


def test_late_corrupt_image_is_an_error_with_file_and_line(root):
    src = build_data_source(config(root, shuffle=False), families(root / "tok"))
    it = src.batches()
    assert len(ids(it, 7)) == 7  # 28 good samples stream before the bad one is reached
    with pytest.raises(DataError) as info:
        next(it)
    assert info.value.location == f"{root / 'a.jsonl'}:{BAD_LINE + 1}"  # +1: the blank line
    assert "cannot decode image" in str(info.value) and "corrupt.png" in str(info.value)


def test_driver_holds_refs_only_and_prefetch_is_bounded(root, tmp_path):
    """Iterating 2 steps preprocesses a bounded window ahead, not the dataset."""
    rec = Recorder(tmp_path / "seen.txt")
    src = build_data_source(config(root, shuffle=False), families(root / "tok"), on_preprocess=rec)
    batch = next(src.batches())
    assert all(isinstance(r, ray.ObjectRef) for s in batch for r in s.inputs.values())
    # the first Ray Data job covers 2 batches' worth of stream entries; the rest waits
    assert sorted(set(rec.seen())) == list(range(8))
    assert np.array([s.num_media_tokens["vision"] for s in batch]).tolist() == [4, 4, 4, 4]


def test_group_by_length_sorts_windows_and_resumes_mid_window(root):
    rows = [caption_sample("a.png", " ".join(["word"] * (1 + (7 * i) % 23))) for i in range(40)]
    path = write_jsonl(root / "lengths.jsonl", rows)
    cfg = config(root, group_by_length=True, shuffle=False)
    cfg.data.train = str(path)
    src = build_data_source(cfg, families(root / "tok"))
    it = src.batches()
    window = [next(it) for _ in range(3)]
    state = src.state()
    assert state["position"] == 0 and state["window_batches_done"] == 3
    window += [next(it) for _ in range(5)]
    # one window = 8 batches = the first 32 samples, each batch a run of similar lengths
    assert sorted(s.index for b in window for s in b) == list(range(32))
    spans = sorted((min(s.num_tokens for s in b), max(s.num_tokens for s in b)) for b in window)
    assert all(hi <= lo2 for (_, hi), (lo2, _) in zip(spans, spans[1:]))
    assert [min(s.num_tokens for s in b) for b in window] != [lo for lo, _ in spans], "batch order shuffled"
    again = build_data_source(cfg, families(root / "tok"))
    assert ids(again.batches(3, state=state), 5) == [[s.index for s in b] for b in window[3:]]
