"""A tiny Qwen2.5-Omni dir (random weights), built offline: the thinker only, laid
out as the published checkpoint (``model_type: qwen2_5_omni``, tensors under
``thinker.*``; ``enable_audio_output: false``, so no talker or token2wav), with
its tokenizer, image processor and audio feature extractor.

The tower is the tiny Qwen2.5-VL one (several windows per image, window and
full-attention blocks); the audio tower takes 16 mel bins in windows of
``2·n_window`` = 20 frames (a 1 s clip spans five), so chunking is exercised.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from disagg_vision_sp.families.tiny_qwen2_5_vl import PROCESSOR, VISION, qwen_tokenizer, tiny_text_config

#: Qwen2.5-Omni's special tokens (the published tokenizer spells them so)
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'video' %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif content['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

AUDIO = dict(
    d_model=32,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=64,
    num_mel_bins=16,
    max_source_positions=100,
    n_window=10,
)
#: Whisper features as the Omni processor computes them (16 kHz, 10 ms hop), 16 mel bins
FEATURES = dict(feature_size=16, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400)


def make_tiny_qwen2_5_omni(out_dir: Path, seed: int = 0) -> Path:
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok, ids = qwen_tokenizer(out, SPECIAL_TOKENS, CHAT_TEMPLATE)
    hidden = 48
    thinker = dict(
        text_config=tiny_text_config(tok, ids, hidden),
        vision_config=dict(VISION, out_hidden_size=hidden),
        audio_config=dict(AUDIO, output_dim=hidden),
        image_token_id=ids["<|IMAGE|>"],
        video_token_id=ids["<|VIDEO|>"],
        audio_token_id=ids["<|AUDIO|>"],
        vision_start_token_id=ids["<|vision_bos|>"],
        vision_end_token_id=ids["<|vision_eos|>"],
        audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    config = Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    # The class that loads this dir is the thinker's: the whole model's from_pretrained
    # also wants the talker's speaker table (spk_dict.pt), which a thinker-only dir lacks.
    cfg_path = out / "config.json"
    saved = json.loads(cfg_path.read_text())
    saved["architectures"] = ["Qwen2_5OmniThinkerForConditionalGeneration"]
    cfg_path.write_text(json.dumps(saved, indent=2))

    proc = Qwen2VLImageProcessorPil(
        patch_size=VISION["patch_size"],
        temporal_patch_size=VISION["temporal_patch_size"],
        merge_size=VISION["spatial_merge_size"],
        **PROCESSOR,
    )
    proc.save_pretrained(out)
    cfg_path = out / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["image_processor_type"] = "Qwen2VLImageProcessor"
    # one preprocessor_config.json holds both, as the published dir's does
    cfg.update(
        WhisperFeatureExtractor(**FEATURES).to_dict(), feature_extractor_type="WhisperFeatureExtractor"
    )
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return out
