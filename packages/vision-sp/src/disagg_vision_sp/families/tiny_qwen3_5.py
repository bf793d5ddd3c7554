"""A whole tiny Qwen3.5 dir (random weights), built offline like the tiny Qwen-VL dirs.

Qwen3.5 is Qwen3-VL's tower without DeepStack mergers in front of a hybrid
decoder: gated-delta-net (linear attention) layers and gated full-attention
layers, in the order ``text_config.layer_types`` gives. The tiny dir keeps
every feature a real dir has at a size a CPU trains in seconds: both layer
kinds (a linear layer after the full one too), grouped value heads in the
linear layers (2 key heads serving 4 value heads, as 16 serve 48 in the 27B),
grouped-query full attention, partial interleaved mRoPE, and a learned
position grid resampled per image in the tower.
"""

from __future__ import annotations

from pathlib import Path

from disagg_vision_sp.families.tiny_qwen2_5_vl import ROPE, VISION_QWEN3_VL, _make_tiny

#: Qwen3-VL's tiny tower less its DeepStack mergers (Qwen3.5 has none)
VISION_QWEN3_5 = {k: v for k, v in VISION_QWEN3_VL.items() if k != "deepstack_visual_indexes"}

#: the hybrid decoder: linear, full, linear; head_dim 16, half of each head rotated (the 27B
#: rotates a quarter of 256): 8 dims -> 4 frequencies, interleaved over (t, h, w) like its [11, 11, 10]
TEXT_QWEN3_5 = dict(
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rope_parameters={
        **ROPE,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
        "partial_rotary_factor": 0.5,
    },
)


def make_tiny_qwen3_5(out_dir: Path, seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer and image processor; deterministic for ``seed``."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    return _make_tiny(
        Path(out_dir),
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        "out_hidden_size",
        VISION_QWEN3_5,
        seed,
        text=TEXT_QWEN3_5,
    )
