"""A whole tiny InternVL HF dir (random weights): InternViT tower + pixel-shuffle
projector + a tiny Qwen2 decoder, with a ChatML tokenizer holding InternVL's image
tokens and GOT-OCR2's image processor (the PIL backend: no torchvision here).

Tiles are 28 px in 7 px patches: 1 + 16 tokens in the tower (no degree > 1 divides
17), 4 rows each after the 2x2 shuffle. The processor tiles an image into up to 4
tiles by its aspect ratio, plus a thumbnail when there are several, as InternVL's does
with 448 px tiles. The CLS token, position table and layer-scale vectors, which
transformers initialises to constants, are drawn at random so that each of them
shapes the output.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<IMG_CONTEXT>\n{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=28,
    patch_size=7,
    layer_scale_init_value=0.1,
)
TILE = 28


def make_tiny_internvl(out_dir: Path, seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer and image processor; deterministic for ``seed``."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from disagg.tiny import train_tokenizer

    out = Path(out_dir)
    tok = train_tokenizer(
        out, SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML, vocab_size=400
    )
    # the names InternVLProcessor reads from the tokenizer (as the published -hf dirs carry them)
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["extra_special_tokens"] = {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    }
    cfg_path.write_text(json.dumps(tok_cfg, indent=2))
    grid = VISION["image_size"] // VISION["patch_size"]
    config = InternVLConfig(
        vision_config=VISION,
        text_config=dict(
            model_type="qwen2",
            vocab_size=len(tok),
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        ),
        image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"),
        image_seq_length=(grid // 2) ** 2,
        downsample_ratio=0.5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        emb = model.model.vision_tower.embeddings
        emb.cls_token.normal_(std=0.5)
        emb.position_embeddings.normal_(std=0.5)
        for layer in model.model.vision_tower.encoder.layer:
            layer.lambda_1.uniform_(0.5, 1.5)
            layer.lambda_2.uniform_(0.5, 1.5)
    model.save_pretrained(out, safe_serialization=True)
    GotOcr2ImageProcessorPil(
        size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1, max_patches=4
    ).save_pretrained(out)
    return out
