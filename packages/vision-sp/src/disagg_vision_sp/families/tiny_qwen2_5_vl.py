"""Whole tiny Qwen2.5-VL, Qwen2-VL and Qwen3-VL HF dirs (random weights), built offline.

Sizes are chosen so that tiny images still exercise everything the real model
does: several attention windows per image, window and full-attention blocks,
the 2x2 spatial merge, and a vision width different from the LLM width.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: Qwen2.5-VL's special tokens, in the order they get their ids.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

#: A Qwen2-VL style chat template (images become vision_start + image_pad + vision_end).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: patch 4 px, merge 2 -> one LLM token per 8x8 px; window 16 px -> 2x2 merged tokens per window.
VISION = dict(
    depth=4,
    hidden_size=32,
    intermediate_size=64,
    num_heads=4,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=16,
    fullatt_block_indexes=[1, 3],
    hidden_act="silu",
)
#: the benchmark's tower (``qwen2_5_vl_deep``): twice the blocks, a full-attention block after every
#: three window blocks (the 32B tower has one after every seven). What recompute frees is the
#: blocks' activations; what it keeps is their inputs, the patch pixels and the merger's. With
#: 4 blocks the pixels and the merger are a larger share of a rank's saved bytes than in any
#: real tower (32 blocks), so a budget search on the shallow tower understates recompute.
VISION_DEEP = dict(VISION, depth=8, fullatt_block_indexes=[3, 7])
#: smallest image: 2x2 merged tokens; largest: 8x8 merged tokens
PROCESSOR = dict(min_pixels=16 * 16, max_pixels=64 * 64)


#: Qwen2-VL's tower: no windows, LayerNorm blocks with a fc1/fc2 MLP (ratio 2 here)
VISION_QWEN2_VL = dict(
    depth=2,
    embed_dim=32,
    mlp_ratio=2,
    num_heads=4,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    hidden_act="quick_gelu",
)


#: Qwen3-VL's tower: learned position grid (4 x 4, resampled per image), two DeepStack
#: mergers (after blocks 0 and 1) beside the final one
VISION_QWEN3_VL = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=64,
    num_heads=4,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 1],
    hidden_act="gelu_pytorch_tanh",
)


def make_tiny_qwen2_5_vl(out_dir: Path, seed: int = 0, vision: dict = VISION) -> Path:
    """Write config, safetensors weights, tokenizer and image processor; deterministic for ``seed``.
    ``vision``: the tower's config (:data:`VISION_DEEP`: the benchmark's 8-block tower)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    return _make_tiny(
        Path(out_dir), Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, "out_hidden_size", vision, seed
    )


def make_tiny_qwen2_vl(out_dir: Path, seed: int = 0) -> Path:
    """A whole tiny Qwen2-VL dir, like :func:`make_tiny_qwen2_5_vl`."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    return _make_tiny(
        Path(out_dir), Qwen2VLConfig, Qwen2VLForConditionalGeneration, "hidden_size", VISION_QWEN2_VL, seed
    )


def make_tiny_qwen3_vl(out_dir: Path, seed: int = 0) -> Path:
    """A whole tiny Qwen3-VL dir (q/k norms, interleaved mRoPE, DeepStack), like the others."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = {"head_dim": 12, "rope_parameters": {**ROPE, "mrope_interleaved": True}}
    model_cls, vision = Qwen3VLForConditionalGeneration, VISION_QWEN3_VL
    return _make_tiny(Path(out_dir), Qwen3VLConfig, model_cls, "out_hidden_size", vision, seed, text=text)


#: text head_dim 12 -> 6 rotary frequencies over (t, h, w)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]}


def qwen_tokenizer(out: Path, special_tokens: list[str], chat_template: str) -> tuple[Any, dict[str, int]]:
    """The tiny Qwen-style tokenizer every tiny Qwen dir (VL and Omni) trains into ``out``, and
    the ids of its special tokens."""
    from disagg.tiny import train_tokenizer

    tok = train_tokenizer(
        out,
        special_tokens,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
        vocab_size=400,
        tokenizer_class="Qwen2TokenizerFast",
    )
    return tok, {t: tok.convert_tokens_to_ids(t) for t in special_tokens}


def tiny_text_config(tok: Any, ids: dict[str, int], hidden: int) -> dict[str, Any]:
    """The tiny Qwen2 decoder the tiny VL and Omni dirs share (2 layers, GQA 4/2, MRoPE)."""
    return dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters=ROPE,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )


def _make_tiny(
    out: Path,
    config_cls: type,
    model_cls: type,
    out_key: str,
    vision: dict,
    seed: int,
    text: dict | None = None,
    **extra: object,
) -> Path:
    """``out_key``: the vision config's name for the merger's output width (the LLM's)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out.mkdir(parents=True, exist_ok=True)
    tok, ids = qwen_tokenizer(out, SPECIAL_TOKENS, CHAT_TEMPLATE)
    text_hidden = 48
    config = config_cls(
        text_config=tiny_text_config(tok, ids, text_hidden) | (text or {}),
        vision_config=dict(vision, **{out_key: text_hidden}),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)

    proc = Qwen2VLImageProcessorPil(
        patch_size=vision["patch_size"],
        temporal_patch_size=vision["temporal_patch_size"],
        merge_size=vision["spatial_merge_size"],
        **PROCESSOR,
    )
    proc.save_pretrained(out)
    # Name the canonical class so installs with torchvision get the fast processor.
    cfg_path = out / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["image_processor_type"] = "Qwen2VLImageProcessor"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return out
