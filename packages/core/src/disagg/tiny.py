"""Offline building blocks for tiny Hugging Face dirs (tests, ``make-tiny``, demo).

Families own their tiny configs; this module only holds what every family
needs and that is not model-specific: a tokenizer trained on the fly with
``tokenizers`` (nothing can be downloaded) and a deterministic corpus.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

COLOURS = ("red", "green", "blue", "yellow", "white", "black")
SHAPES = ("square", "circle", "triangle", "cross")


def corpus() -> list[str]:
    """Text the tiny tokenizers are trained on: demo captions and prompts."""
    lines = ["Describe the image.", "What is in the picture?", "Describe the sound.", "Answer briefly."]
    for c in COLOURS:
        for s in SHAPES:
            lines.append(f"A {c} {s}.")
            lines.append(f"The picture shows a {c} {s} on a dark background.")
    lines += [
        "A tone.",
        "A high tone.",
        "A low tone.",
        "user",
        "assistant",
        "system",
        "You are a helpful assistant.",
    ]
    return lines


def train_tokenizer(
    out_dir: str | Path,
    special_tokens: list[str],
    *,
    bos_token: str | None = None,
    eos_token: str,
    pad_token: str,
    unk_token: str | None = None,
    chat_template: str | None = None,
    vocab_size: int = 512,
    extra_text: Iterable[str] = (),
    tokenizer_class: str = "PreTrainedTokenizerFast",
    model_max_length: int = 4096,
):
    """Train a byte-level BPE tokenizer and save it as an HF tokenizer dir.

    Special tokens get the first ids, in the order given, so configs built
    afterwards can read them back with ``convert_tokens_to_ids``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=unk_token))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus()) + list(extra_text), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token=pad_token,
        unk_token=unk_token,
        additional_special_tokens=[
            t for t in special_tokens if t not in {bos_token, eos_token, pad_token, unk_token}
        ],
        model_max_length=model_max_length,
    )
    if chat_template:
        fast.chat_template = chat_template
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    if tokenizer_class != "PreTrainedTokenizerFast":
        # Record the family's tokenizer class so AutoTokenizer builds the same one.
        import json

        cfg_path = out / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["tokenizer_class"] = tokenizer_class
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return fast
