"""LLaMA-Factory- and ms-swift-shaped data on the real tiny Qwen2.5-VL: a ``dataset_info.json``
dir with a ``sharegpt`` dataset (messages + images, multi-turn, an image in a later turn) and an
``alpaca`` one with images, an ms-swift ``query``/``response``/``history`` file and a file of
Qwen's inline content parts. Every sample's tokens, labels and pixel values equal its LLaVA-form
twin's, and the four train together in one run."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("disagg_vision_sp")

#: one step of 8 samples in 2 microbatches; datasets are drawn by weight, and seed 5's first
#: 8 draws take from each of the four
STEPS, BATCH, SEED = 1, 8, 5
SYSTEM = "You see shapes."


def _ask(text: str) -> list[dict]:
    return [{"type": "text", "text": text}]


def _img(name: str) -> dict:
    return {"type": "image", "image": f"images/{name}.png"}


# each form: rows, and per row its LLaVA twin's (turns, images)
CHAT = [
    (
        {
            "messages": [
                {"role": "user", "content": "<image>Who is it?"},
                {"role": "assistant", "content": "A red square."},
                {"role": "user", "content": "And now?<image>"},
                {"role": "assistant", "content": "A wide one."},
            ],
            "images": ["images/small.png", "images/wide.png"],
        },
        [("user", "<image>Who is it?"), ("assistant", "A red square."), ("user", "And now?<image>")]
        + [("assistant", "A wide one.")],
        ["small", "wide"],
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "<image>What is it?"},
                {"role": "assistant", "content": "A large square."},
            ],
            "images": ["images/large.png"],
        },
        [
            ("user", "Hi."),
            ("assistant", "Hello."),
            ("user", "<image>What is it?"),
            ("assistant", "A large square."),
        ],
        ["large"],
    ),
]
ALPACA = [
    (
        {
            "instruction": "<image>Describe.",
            "input": "Briefly.",
            "output": "A red square.",
            "images": ["images/small.png"],
            "system": SYSTEM,
            "history": [["Hi.", "Hello."]],
        },
        [("system", SYSTEM), ("user", "Hi."), ("assistant", "Hello."), ("user", "<image>Describe.\nBriefly.")]
        + [("assistant", "A red square.")],
        ["small"],
    ),
    (
        {"instruction": "<image><image>Compare.", "input": "", "output": "Two squares.", "images": []}
        | {"images": ["images/wide.png", "images/large.png"]},
        [("user", "<image><image>Compare."), ("assistant", "Two squares.")],
        ["wide", "large"],
    ),
]
SWIFT = [
    (
        {
            "system": SYSTEM,
            "query": "And this?<image>",
            "response": "A wide one.",
            "history": [["<image>What is it?", "A red square."]],
            "images": ["images/small.png", "images/wide.png"],
        },
        [("system", SYSTEM), ("user", "<image>What is it?"), ("assistant", "A red square.")]
        + [("user", "And this?<image>"), ("assistant", "A wide one.")],
        ["small", "wide"],
    ),
    # no marker: ms-swift puts it at the start of the first user turn
    (
        {"query": "What is it?", "response": "A large square.", "images": ["images/large.png"]},
        [("user", "<image>What is it?"), ("assistant", "A large square.")],
        ["large"],
    ),
]
QWEN = [
    (
        {
            "messages": [
                {"role": "system", "content": _ask(SYSTEM)},
                {"role": "user", "content": _ask("Hi.")},
                {"role": "assistant", "content": _ask("Hello.")},
                {"role": "user", "content": [_img("large"), *_ask("What is it?")]},
                {"role": "assistant", "content": _ask("A large square.")},
            ]
        },
        [("system", SYSTEM), ("user", "Hi."), ("assistant", "Hello."), ("user", "<image>What is it?")]
        + [("assistant", "A large square.")],
        ["large"],
    ),
    (
        {
            "messages": [
                {"role": "user", "content": [_img("small"), *_ask("and"), _img("wide"), *_ask("Compare.")]},
                {"role": "assistant", "content": "Two red shapes."},
            ]
        },
        [("user", "<image>and<image>Compare."), ("assistant", "Two red shapes.")],
        ["small", "wide"],
    ),
]
TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
INFO = {
    # LLaMA-Factory's mllm_demo entry, as its data/dataset_info.json has it
    "mm_chat": {
        "file_name": "mm_chat.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "images": "images"},
        "tags": TAGS,
    },
    "mm_alpaca": {
        "file_name": "mm_alpaca.jsonl",
        "columns": {"prompt": "instruction", "query": "input", "response": "output"}
        | {"system": "system", "history": "history", "images": "images"},
    },
}


@pytest.fixture(scope="module")
def lf(tmp_path_factory):
    from disagg.cli.make_tiny import make_tiny
    from disagg.data.demo_data import draw_shape

    out = tmp_path_factory.mktemp("lf_e2e")
    tiny = make_tiny(out / "tiny", ["qwen2_5_vl"], data=False)
    d = out / "data"
    (d / "images").mkdir(parents=True)
    rng = random.Random(0)
    for name, (w, h) in {"small": (28, 28), "wide": (56, 28), "large": (56, 56)}.items():
        draw_shape("red", "square", max(w, h), rng).resize((w, h)).save(d / "images" / f"{name}.png")
    (d / "dataset_info.json").write_text(json.dumps(INFO, indent=2))
    (d / "mm_chat.json").write_text(json.dumps([r for r, _, _ in CHAT], indent=2))
    for name, rows in (("mm_alpaca.jsonl", ALPACA), ("swift.jsonl", SWIFT), ("qwen.jsonl", QWEN)):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r, _, _ in rows))
    return {"path": tiny["models"]["qwen2_5_vl"], "dir": d}


def _config(lf: dict, out: Path):
    from disagg.config.schema import Config
    from disagg.config.validate import validate
    from disagg.plugins import get_registry

    d, ddp = lf["dir"], {"strategy": "ddp"}
    cfg = Config.model_validate(
        {
            "model": {m: {"family": "qwen2_5_vl", "path": lf["path"]} for m in ("vision", "llm")},
            "parallel": {"vision": ddp, "llm": ddp},
            "data": {
                "dataset_dir": str(d),
                # two dataset_info.json names and two files of their own beside them
                "train": [{"path": "mm_chat"}, {"path": "mm_alpaca"}]
                + [{"path": str(d / f), "media_root": str(d)} for f in ("swift.jsonl", "qwen.jsonl")],
                "batch_size": BATCH,
                "shuffle": False,
                "num_workers": 1,
            },
            "train": {"steps": STEPS, "lr": 1e-3, "eps": 1e-3, "seed": SEED, "microbatches": 2},
            "checkpoint": {"every": 0},
            "output_dir": str(out),
        }
    )
    validate(cfg, get_registry())
    return cfg


def test_each_form_tokenizes_as_its_llava_twin(lf, tmp_path):
    """input_ids, labels and pixel values (every tensor of every module) equal the LLaVA twin's."""
    from disagg.data.files import dataset_files
    from disagg.data.preprocess import preprocess_record
    from disagg.data.records import Record, parse_sample
    from disagg.plugins import get_registry
    from disagg.runtime.plan import families_for

    cfg = _config(lf, tmp_path)
    fams = families_for(cfg, get_registry())
    tok = fams["llm"].tokenizer()
    d = lf["dir"]

    def inputs(item, fmt, columns=None):
        messages, media = parse_sample(item, "t", d, {"image"}, fmt, "", columns)
        return preprocess_record(Record(0, 0, "t", messages, media), fams, tok).inputs

    files = dataset_files(cfg, "train")
    assert [f.format for f in files] == ["sharegpt", "alpaca", "auto", "auto"]
    from disagg.data.files import index_file

    assert [index_file(f).format for f in files] == ["sharegpt", "alpaca", "query_response", "sharegpt"]
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    for f, rows in zip(files, (CHAT, ALPACA, SWIFT, QWEN)):
        fmt = index_file(f).format
        for row, turns, images in rows:
            twin = {"conversations": [{"from": names[r], "value": t} for r, t in turns]}
            twin["image"] = [f"images/{i}.png" for i in images]
            got, want = inputs(row, fmt, f.columns), inputs(twin, "llava")
            assert got.keys() == want.keys() == {"vision", "llm"}
            assert "pixel_values" in want["vision"] and (want["llm"]["labels"] != -100).any()
            for m in want:
                assert got[m].keys() == want[m].keys(), (f.path, m)
                for k in want[m]:
                    assert torch.equal(got[m][k], want[m][k]), (f.path, m, k)


def test_the_four_forms_train_together(ray_local, lf, tmp_path):
    from disagg.config.validate import validate
    from disagg.data.files import dataset_files, index_file
    from disagg.data.order import StreamOrder
    from disagg.plugins import get_registry
    from disagg.runtime.run import run_training

    cfg = _config(lf, tmp_path / "run")
    sizes = [index_file(f).size for f in dataset_files(cfg, "train")]
    ds, _ = StreamOrder(sizes, [1.0] * 4, seed=SEED, shuffle=False).take(0, STEPS * BATCH)
    assert set(ds.tolist()) == {0, 1, 2, 3}  # the run's samples come from every form
    run_training(validate(cfg, get_registry()), progress=False)
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in metrics)
