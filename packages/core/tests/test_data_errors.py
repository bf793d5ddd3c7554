"""Every kind of bad data gives a DataError naming file and line/sample, or a counted skip.

Samples are validated as the stream reaches them (see test_data_stream.py for a
bad sample late in a long stream), so each test pulls the batches that cover it;
``shuffle: false`` keeps the stream in file order.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest
import ray
import test_data_fakes
import torch
from test_data_fakes import caption_sample, families, make_tokenizer_dir, write_image, write_jsonl

from disagg.config.schema import Config
from disagg.data import DataError, build_data_source

ray.cloudpickle.register_pickle_by_value(test_data_fakes)  # Ray workers cannot import test modules


@pytest.fixture(scope="module")
def root(tmp_path_factory, ray_local):
    root = tmp_path_factory.mktemp("bad")
    make_tokenizer_dir(root)
    write_image(root / "ok.png", 8, 8)
    (root / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 4)
    return root


def config(root: Path, train, **data) -> Config:
    return Config(
        model={
            "vision": {"family": "fake_image", "path": str(root / "tok")},
            "llm": {"family": "fake_lm", "path": str(root / "tok")},
        },
        data={
            "train": train,
            "media_root": str(root),
            "batch_size": 2,
            "num_workers": 1,
            "shuffle": False,
            **data,
        },
    )


def stream(cfg: Config, steps: int = 2):
    """The source and its first ``steps`` batches (enough to reach every sample here)."""
    src = build_data_source(cfg, families(Path(cfg.data.media_root) / "tok"))
    return src, list(islice(src.batches(), steps))


def turns(*pairs):
    return [{"from": r, "value": v} for r, v in pairs]


GOOD = caption_sample("ok.png", "A red square.")
# (line content, expected problem) -- the structural cases, found before any worker starts
STRUCTURAL = [
    ('{"image": "ok.png", "conversations": [', "malformed JSON"),
    (caption_sample("missing.png", "A cat."), "missing image file 'missing.png'"),
    (
        {"image": "ok.png", "conversations": turns(("human", "Describe."), ("gpt", "A."))},
        "0 <image> placeholder(s) in the text but 1 image file(s)",
    ),
    ({"conversations": turns(("human", "<image> <image>"), ("gpt", "A."))}, "2 <image> placeholder(s)"),
    ({"image": "ok.png", "conversations": []}, "empty conversation"),
    (
        {"image": "ok.png", "conversations": turns(("human", "<image>"), ("robot", "A."))},
        "unknown role 'robot'; allowed: system, human, user, gpt, assistant",
    ),
    ({"image": "ok.png", "conversations": turns(("human", "<image>"))}, "no assistant"),
    (
        {"audio": "x.wav", "conversations": turns(("human", "<audio>"), ("gpt", "A."))},
        "sample has audio but no audio encoder is configured",
    ),
    (
        {"image": 3, "conversations": turns(("human", "<image>"), ("gpt", "A."))},
        "'image' must be a file name",
    ),
    ([1, 2], "a sample must be a JSON object"),
]


@pytest.mark.parametrize("bad,problem", STRUCTURAL, ids=[p[:20] for _, p in STRUCTURAL])
def test_structural_error_names_file_and_line(root: Path, bad, problem):
    path = write_jsonl(root / "one_bad.jsonl", [GOOD, GOOD, bad])
    with pytest.raises(DataError) as info:
        stream(config(root, str(path)))
    assert str(info.value).startswith(f"{path}:3: ")
    assert problem in str(info.value)
    assert info.value.location == f"{path}:3"


def test_malformed_json_file_names_line(root: Path):
    path = root / "bad.json"
    path.write_text('[\n  {"image": "ok.png",\n   "conversations": [}\n]\n')
    with pytest.raises(DataError, match=r"bad\.json:3: malformed JSON"):
        stream(config(root, str(path)))


def test_json_list_names_sample_index(root: Path):
    path = root / "list.json"
    path.write_text(json.dumps([GOOD, {"image": "ok.png", "conversations": []}]))
    with pytest.raises(DataError, match=r"list\.json\[1\]: empty conversation"):
        stream(config(root, str(path)))


def test_corrupt_image_error_names_sample(root: Path):
    path = write_jsonl(root / "corrupt.jsonl", [GOOD, caption_sample("corrupt.png", "A."), GOOD])
    with pytest.raises(DataError) as info:
        stream(config(root, str(path)))
    assert info.value.location == f"{path}:2"
    assert "cannot decode image" in str(info.value) and "corrupt.png" in str(info.value)


def test_too_long_error_and_drop(root: Path):
    long = caption_sample("ok.png", " ".join(["A red square."] * 20))
    path = write_jsonl(root / "long.jsonl", [GOOD, long, GOOD])
    with pytest.raises(
        DataError, match=r"long\.jsonl:2: \d+ tokens exceed data\.max_tokens=60.*allowed: error, drop"
    ):
        stream(config(root, str(path), max_tokens=60))
    # too long is its own policy: on_error: skip does not swallow it
    with pytest.raises(DataError, match="exceed data.max_tokens"):
        stream(config(root, str(path), max_tokens=60, on_error="skip"))
    src, (first,) = stream(config(root, str(path), max_tokens=60, on_too_long="drop"), steps=1)
    # 3 samples in the file; the dropped one is counted and the batch refilled
    assert src.stats() == {"samples": 3, "skipped": 0, "dropped_too_long": 1, "truncated": 0}
    assert [s.source for s in first] == [f"{path}:1", f"{path}:3"]


def _processed(root: Path, item: dict, **policy):
    from disagg.data.preprocess import preprocess_record
    from disagg.data.records import Record, parse_sample

    fams = families(root / "tok")
    messages, media = parse_sample(item, "t.jsonl:1", root, {"image"})
    return preprocess_record(
        Record(0, 0, "t.jsonl:1", messages, media), fams, fams["llm"].tokenizer(), **policy
    )


def test_truncate_cuts_after_the_media_or_refuses(root: Path):
    from disagg.data.preprocess import TooLongError

    write_image(root / "big.png", 32, 32)  # 64 placeholder tokens
    long = caption_sample("ok.png", " ".join(["A red square."] * 20))
    full = _processed(root, long)
    cut = _processed(root, long, max_tokens=40, on_too_long="truncate")
    assert full.num_tokens > 40 and cut.truncated and cut.num_tokens == 40
    # the first 40 tokens and their labels, unchanged; every placeholder kept
    for k in ("input_ids", "labels"):
        assert torch.equal(cut.inputs["llm"][k], full.inputs["llm"][k][:40])
    assert cut.num_media_tokens == full.num_media_tokens == {"vision": 4}
    assert 0 < cut.num_label_tokens < full.num_label_tokens
    assert torch.equal(cut.inputs["vision"]["pixels"], full.inputs["vision"]["pixels"])
    # a short sample is left alone
    assert not _processed(root, GOOD, max_tokens=40, on_too_long="truncate").truncated
    # the cut would fall inside the image's 64 placeholders: refused, not a half image
    with pytest.raises(TooLongError, match=r"t\.jsonl:1: \d+ tokens .* would cut vision placeholder tokens"):
        _processed(root, caption_sample("big.png", "A."), max_tokens=40, on_too_long="truncate")
    # the cut would leave nothing to learn: refused
    labels = _processed(root, GOOD).inputs["llm"]["labels"]
    first_label = int(torch.nonzero(labels != -100)[0])
    with pytest.raises(TooLongError, match="no assistant token is left"):
        _processed(root, GOOD, max_tokens=first_label, on_too_long="truncate")


def test_too_long_policies_through_the_stream(root: Path):
    """error stops at the sample, drop skips and counts it, truncate cuts and counts it; a
    truncation that would cut an image stops the run even with on_error: skip."""
    write_image(root / "big.png", 32, 32)
    long = caption_sample("ok.png", " ".join(["A red square."] * 20))
    path = write_jsonl(root / "policies.jsonl", [GOOD, long, GOOD, long])
    with pytest.raises(DataError, match=rf"{path}:2: \d+ tokens exceed data.max_tokens=40"):
        stream(config(root, str(path), max_tokens=40))
    src, batches = stream(config(root, str(path), max_tokens=40, on_too_long="drop"), steps=1)
    assert src.stats()["dropped_too_long"] == 1 and [s.source for s in batches[0]] == [
        f"{path}:1",
        f"{path}:3",
    ]
    src, batches = stream(config(root, str(path), max_tokens=40, on_too_long="truncate"))
    assert src.stats() == {"samples": 4, "skipped": 0, "dropped_too_long": 0, "truncated": 2}
    assert [s.num_tokens for s in batches[0] + batches[1]][1::2] == [40, 40]
    bad = write_jsonl(root / "cut_image.jsonl", [GOOD, caption_sample("big.png", "A.")])
    with pytest.raises(DataError, match=rf"{bad}:2: .*would cut vision placeholder tokens"):
        stream(config(root, str(bad), max_tokens=40, on_too_long="truncate", on_error="skip"))


def test_skip_counts_every_bad_sample(root: Path):
    bad = [b for b, _ in STRUCTURAL if not (isinstance(b, dict) and "audio" in b)]
    bad.append(caption_sample("corrupt.png", "A."))
    lines = [GOOD] + bad + [GOOD]
    path = write_jsonl(root / "mixed.jsonl", lines)
    src, (first,) = stream(config(root, str(path), on_error="skip"), steps=1)
    assert src.stats() == {"samples": len(lines), "skipped": len(bad), "dropped_too_long": 0, "truncated": 0}
    # nothing silent: each skip is recorded with its location
    assert sorted(p.split(": ")[0] for p in src.problems) == sorted(
        f"{path}:{i}" for i in range(2, len(lines))
    )
    assert [s.source for s in first] == [f"{path}:1", f"{path}:{len(lines)}"]


def test_all_bad_is_an_error(root: Path):
    path = write_jsonl(root / "allbad.jsonl", [caption_sample("corrupt.png", "A.")])
    with pytest.raises(DataError, match="no usable samples"):
        stream(config(root, str(path), on_error="skip"))
