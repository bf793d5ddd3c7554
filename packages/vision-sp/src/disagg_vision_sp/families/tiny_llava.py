"""A whole tiny LLaVA HF dir: SigLIP vision tower + MLP projector + tiny Llama (random weights),
or, with ``tower="clip"``, llava-1.5's layout: a CLIP tower whose CLS token is
dropped from the features (``vision_feature_select_strategy: default``).

30x30 px images in 6 px patches give 25 tokens per image, which no degree > 1
divides (CLIP: 26 inside the tower); the feature layer is the second to last
(LLaVA's default), so the last tower layer is loaded but unused, as in real
LLaVA checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<image>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}</s>{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT: {% endif %}"
)

VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=30,
    patch_size=6,
    vision_use_head=False,
)


def make_tiny_llava(out_dir: Path, seed: int = 0, tower: str = "siglip") -> Path:
    """Write config, safetensors weights, tokenizer and image processor; deterministic for ``seed``."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    from disagg.tiny import train_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(
        out,
        SPECIAL_TOKENS,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        vocab_size=400,
    )
    n_patches = (VISION["image_size"] // VISION["patch_size"]) ** 2
    if tower == "clip":
        clip = {k: v for k, v in VISION.items() if k != "vision_use_head"}
        vision_config, select = CLIPVisionConfig(**clip, hidden_act="quick_gelu"), "default"
    else:
        vision_config, select = SiglipVisionConfig(**VISION), "full"
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=dict(
            model_type="llama",
            vocab_size=len(tok),
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            bos_token_id=tok.convert_tokens_to_ids("<s>"),
            eos_token_id=tok.convert_tokens_to_ids("</s>"),
            pad_token_id=tok.convert_tokens_to_ids("<pad>"),
        ),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=n_patches,
        vision_feature_select_strategy=select,
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    side = VISION["image_size"]
    if tower == "clip":
        # llava-1.5's processing: shortest edge resized to the tower's size, then a centre crop
        proc = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    else:
        proc = SiglipImageProcessorPil(size={"height": side, "width": side})
    proc.save_pretrained(out)
    return out
