"""Tokenization and label masks, checked against hand-written expectations (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_data_fakes import SYSTEM, caption_sample, families, make_tokenizer_dir, write_image, write_wav

from disagg.data.preprocess import IGNORE, preprocess_record
from disagg.data.records import Record, parse_sample

PAD4 = "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    tok_dir = make_tokenizer_dir(root)
    write_image(root / "small.png", 8, 8)  # 2x2 patches -> 4 tokens
    write_image(root / "wide.png", 16, 8, (0, 0, 255))  # 2x4 -> 8 tokens
    write_wav(root / "beep.wav", 250)  # 3 tokens
    fams = families(tok_dir, audio=True)
    return root, fams, fams["llm"].tokenizer()


def run(env, item):
    root, fams, tok = env
    messages, media = parse_sample(item, "t.jsonl:1", root, {"image", "audio"})
    return preprocess_record(Record(0, 0, "t.jsonl:1", messages, media), fams, tok), tok


def decode(tok, ids: torch.Tensor) -> str:
    return tok.decode(ids.tolist(), skip_special_tokens=False)


def label_text(tok, out) -> list[str]:
    """The labelled spans as text, one string per contiguous run."""
    lab = out.inputs["llm"]["labels"]
    ids = out.inputs["llm"]["input_ids"]
    runs, cur = [], []
    for i, label in zip(ids.tolist(), lab.tolist()):
        if label != IGNORE:
            assert label == i
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def test_single_turn(env):
    out, tok = run(env, caption_sample("small.png", "A red square."))
    llm = out.inputs["llm"]
    assert decode(tok, llm["input_ids"]) == (
        SYSTEM
        + f"<|im_start|>user\n{PAD4}\nDescribe.<|im_end|>\n<|im_start|>assistant\nA red square.<|im_end|>\n"
    )
    assert label_text(tok, out) == ["A red square.<|im_end|>\n"]
    assert llm["input_ids"].dtype == torch.int64 and llm["labels"].dtype == torch.int64
    assert out.num_tokens == len(llm["input_ids"])
    assert out.num_label_tokens == int((llm["labels"][1:] != IGNORE).sum())
    assert out.num_media_tokens == {"vision": 4}
    # the family's extra inputs ride along with the LLM inputs; the encoder gets its preprocess output
    assert llm["image_grid"].tolist() == [[2, 2]]
    assert out.inputs["vision"]["pixels"].shape == (64, 3)
    # the labelled run is the tail of the sequence: everything before it is masked
    first = int((llm["labels"] != IGNORE).nonzero()[0])
    assert (llm["labels"][:first] == IGNORE).all() and (llm["labels"][first:] != IGNORE).all()


def test_multi_turn(env):
    item = {
        "image": "small.png",
        "conversations": [
            {"from": "human", "value": "<image>\nDescribe."},
            {"from": "gpt", "value": "A red square."},
            {"from": "human", "value": "Answer briefly."},
            {"from": "gpt", "value": "A square."},
        ],
    }
    out, tok = run(env, item)
    assert decode(tok, out.inputs["llm"]["input_ids"]) == (
        SYSTEM
        + f"<|im_start|>user\n{PAD4}\nDescribe.<|im_end|>\n<|im_start|>assistant\nA red square.<|im_end|>\n"
        "<|im_start|>user\nAnswer briefly.<|im_end|>\n<|im_start|>assistant\nA square.<|im_end|>\n"
    )
    assert label_text(tok, out) == ["A red square.<|im_end|>\n", "A square.<|im_end|>\n"]


def test_multi_image_and_audio_in_order(env):
    item = {
        "image": ["wide.png", "small.png"],
        "audio": "beep.wav",
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {
                "role": "user",
                "content": [
                    {"type": "image"},
                    {"type": "text", "text": " and "},
                    {"type": "image"},
                    {"type": "text", "text": " <audio>"},
                ],
            },
            {"role": "assistant", "content": "A blue square."},
        ],
    }
    out, tok = run(env, item)
    pad8 = "<|vision_start|>" + "<|image_pad|>" * 8 + "<|vision_end|>"
    aud3 = "<|vision_start|>" + "<|audio_pad|>" * 3 + "<|vision_end|>"
    assert decode(tok, out.inputs["llm"]["input_ids"]) == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n"
        f"<|im_start|>user\n{pad8} and {PAD4} {aud3}<|im_end|>\n"
        "<|im_start|>assistant\nA blue square.<|im_end|>\n"
    )
    assert label_text(tok, out) == ["A blue square.<|im_end|>\n"]
    assert out.num_media_tokens == {"vision": 12, "audio": 3}
    assert out.inputs["vision"]["grid"].tolist() == [[2, 4], [2, 2]]  # placeholder order = file order
    assert out.inputs["audio"]["lengths"].tolist() == [250]


def test_text_only(env):
    item = {
        "conversations": [
            {"from": "human", "value": "What is in the picture?"},
            {"from": "gpt", "value": "A circle."},
        ]
    }
    out, tok = run(env, item)
    assert set(out.inputs) == {"llm"}
    assert set(out.inputs["llm"]) == {"input_ids", "labels"}
    assert decode(tok, out.inputs["llm"]["input_ids"]) == (
        SYSTEM
        + "<|im_start|>user\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\nA circle.<|im_end|>\n"
    )
    assert label_text(tok, out) == ["A circle.<|im_end|>\n"]
    assert out.num_media_tokens == {}


def test_labels_match_template_prefix(env):
    """The label span starts exactly after the template's generation prompt."""
    out, tok = run(env, caption_sample("small.png", "A green cross."))
    ids = out.inputs["llm"]["input_ids"]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": f"{PAD4}\nDescribe."}], tokenize=False, add_generation_prompt=True
    )
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert ids[:n_prompt].tolist() == tok(prompt, add_special_tokens=False)["input_ids"]
    assert (out.inputs["llm"]["labels"][:n_prompt] == IGNORE).all()
    assert (out.inputs["llm"]["labels"][n_prompt:] == ids[n_prompt:]).all()


def test_tokenizer_without_chat_template_is_reported(env, tmp_path: Path):
    from disagg.tiny import train_tokenizer

    root, fams, _ = env
    bare = tmp_path / "bare"
    train_tokenizer(bare, ["<|im_end|>", "<|image_pad|>"], eos_token="<|im_end|>", pad_token="<|im_end|>")
    from test_data_fakes import FakeLMFamily

    fam = FakeLMFamily(bare)
    messages, media = parse_sample(
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "A tone."}]},
        "x",
        root,
        set(),
    )
    with pytest.raises(ValueError, match="no chat template"):
        preprocess_record(Record(0, 0, "x", messages, media), {"llm": fam}, fam.tokenizer())
