"""Tiny random-weight configs and tokenizers shared by the families' ``make_tiny``.

Sizes follow the test plan: hidden 64, 2 layers, 4 query heads and 2
key/value heads (so degree 4 exercises key/value replication).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from disagg.tiny import train_tokenizer

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>{% elif part['type'] == 'audio' %}<audio>{% endif %}{% endfor %}{% endif %}"
    "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|AUDIO|>",
]
LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<image>",
    "<audio>",
]


def qwen_tokenizer(out_dir: Path, vocab_size: int = 480) -> Any:
    return train_tokenizer(
        out_dir,
        QWEN_SPECIALS,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
        vocab_size=vocab_size,
    )


def llama_tokenizer(out_dir: Path, vocab_size: int = 480) -> Any:
    return train_tokenizer(
        out_dir,
        LLAMA_SPECIALS,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
        chat_template=LLAMA_TEMPLATE,
        vocab_size=vocab_size,
    )


def decoder_sizes(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    sizes = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    sizes.update(overrides)
    return sizes


def save_random(model_cls: type, config: Any, out_dir: Path, seed: int = 0) -> Path:
    """Random weights (seeded) saved in HF format next to the tokenizer."""
    torch.manual_seed(seed)
    model = model_cls(config)
    model.save_pretrained(out_dir)
    return Path(out_dir)
