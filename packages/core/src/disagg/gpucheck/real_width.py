"""Qwen2.5-VL-32B's vision block and LLM layer built from its config alone (random weights,
no download), at full width on CUDA and at a scaled-down width on CPU (so the CPU run stays
seconds long while every code path runs), plus the cost model's shapes of the same config."""

from __future__ import annotations

import copy
from typing import Any

import torch

from disagg.bench.published import QWEN2_5_VL_32B

#: the CPU run's width divisor: heads and widths over 8 (head dims kept: 80 vision, 128 LLM)
CPU_SCALE = 8
#: tokens of one sequence: the issue's long sequence on CUDA, a short one on CPU
TOKENS = {"cuda": 16384, "cpu": 256}


def config(device: torch.device) -> dict[str, Any]:
    """The 32B config (CUDA) or its width-scaled copy (CPU)."""
    cfg = copy.deepcopy(QWEN2_5_VL_32B)
    if device.type == "cuda":
        return cfg
    v, t, s = cfg["vision_config"], cfg["text_config"], CPU_SCALE
    v.update(hidden_size=v["hidden_size"] // s, intermediate_size=v["intermediate_size"] // s)
    v.update(num_heads=v["num_heads"] // s, out_hidden_size=t["hidden_size"] // s)
    t.update(hidden_size=t["hidden_size"] // s, intermediate_size=t["intermediate_size"] // s)
    t.update(
        num_attention_heads=t["num_attention_heads"] // s, num_key_value_heads=t["num_key_value_heads"] // s
    )
    return cfg


def vision_block(cfg: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """One ``Qwen2_5_VLVisionBlock`` (HF's class) of the config, random weights."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionBlock

    vc = Qwen2_5_VLConfig(vision_config=cfg["vision_config"]).vision_config
    vc._attn_implementation = "sdpa"  # noqa: SLF001  (what from_pretrained sets)
    torch.manual_seed(0)
    return Qwen2_5_VLVisionBlock(vc).to(device=device, dtype=dtype)


def vision_rotary(cfg: dict[str, Any], n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of the tower's 2-D rotary for ``n`` patch tokens (positions of a square-ish grid)."""
    v = cfg["vision_config"]
    hd = v["hidden_size"] // v["num_heads"]
    freqs = torch.randn(n, hd // 2, device=device)  # positions only shape the values, not the cost
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def llm_layer(cfg: dict[str, Any], device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """One decoder layer of the LLM (``Qwen2DecoderLayer``: Qwen2.5-VL's text layer is Qwen2's,
    its mRoPE only changes the cos/sin it is given), random weights; and its rotary module."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    t = cfg["text_config"]
    qc = Qwen2Config(
        hidden_size=t["hidden_size"],
        intermediate_size=t["intermediate_size"],
        num_attention_heads=t["num_attention_heads"],
        num_key_value_heads=t["num_key_value_heads"],
        num_hidden_layers=1,
        vocab_size=t["vocab_size"],
        max_position_embeddings=65536,
    )
    qc._attn_implementation = "sdpa"  # noqa: SLF001
    torch.manual_seed(0)
    return Qwen2DecoderLayer(qc, 0).to(device=device, dtype=dtype), Qwen2RotaryEmbedding(qc).to(device)


def shapes(cfg: dict[str, Any]) -> dict[str, Any]:
    """The cost model's shapes of the config (the families' ``planning_shape``)."""
    from disagg.cost.shapes import shapes_for

    return shapes_for({"vision": cfg, "llm": cfg}, {"vision": "qwen2_5_vl", "llm": "qwen2_5_vl"})
