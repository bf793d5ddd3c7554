"""Tiny random-weight Whisper and Qwen2-Audio HF dirs, built offline.

Sizes keep everything the real models do at a fraction of the cost: a 1 s
window (so a 2.5 s clip already needs three windows) at 16 kHz with 16 mel
bins gives 100 mel frames and 50 encoder positions per window; 2 layers,
4 heads, width 32 (the Qwen2-Audio LLM is 48 wide, so the projector changes
width as in the real model).
"""

from __future__ import annotations

from pathlib import Path

import torch

#: 1 s windows of 16 kHz audio -> 100 mel frames -> 50 encoder positions
FEATURES = dict(feature_size=16, sampling_rate=16000, hop_length=160, chunk_length=1, n_fft=400)
ENCODER = dict(
    d_model=32,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=64,
    num_mel_bins=16,
    max_source_positions=50,
)

QWEN2_AUDIO_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|AUDIO|>",
]

#: Qwen2-Audio's chat template shape (audio becomes audio_bos + AUDIO + audio_eos)
QWEN2_AUDIO_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' or 'audio' in content %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _feature_extractor(out: Path) -> None:
    from transformers import WhisperFeatureExtractor

    WhisperFeatureExtractor(**FEATURES).save_pretrained(out)


def make_tiny_whisper(out_dir: Path, seed: int = 0) -> Path:
    """A whole tiny Whisper (encoder + a 1-layer decoder, as real dirs hold) and its feature extractor."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = WhisperConfig(
        vocab_size=64,
        decoder_layers=1,
        decoder_attention_heads=4,
        decoder_ffn_dim=64,
        max_target_positions=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        **ENCODER,
    )
    torch.manual_seed(seed)
    WhisperForConditionalGeneration(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    _feature_extractor(out)
    return out


def make_tiny_qwen2_audio(out_dir: Path, seed: int = 0) -> Path:
    """A whole tiny Qwen2-Audio dir: audio tower, projector, a tiny Qwen2 LLM,
    tokenizer with its audio tokens, and the feature extractor."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    from disagg.tiny import train_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(
        out,
        QWEN2_AUDIO_TOKENS,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN2_AUDIO_TEMPLATE,
        vocab_size=400,
    )
    config = Qwen2AudioConfig(
        audio_config=dict(model_type="qwen2_audio_encoder", **ENCODER),
        text_config=dict(
            model_type="qwen2",
            vocab_size=len(tok),
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        ),
        audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"),
    )
    torch.manual_seed(seed)
    Qwen2AudioForConditionalGeneration(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    _feature_extractor(out)
    return out
