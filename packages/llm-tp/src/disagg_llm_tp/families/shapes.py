"""The LLM families' decoders as the cost hooks see them (``Family.planning_shape``)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from disagg.interfaces.shapes import DecoderShape, ParamTensor, config_int, decoder_shape


def hf_decoder_shape(cfg: dict[str, Any]) -> DecoderShape:
    """A Qwen2/Llama-style decoder from a decoder's ``config.json`` or a whole
    multimodal dir's ``text_config``; tied embeddings as the top level says."""
    text = cfg.get("text_config") or cfg
    tie = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    shape = decoder_shape(text, tie)
    bias = text.get("attention_bias")  # Qwen3 and Llama say it; Qwen2 always has q/k/v biases
    return shape if bias is None else replace(shape, qkv_bias=bool(bias))


@dataclass(frozen=True)
class QKNormDecoderShape(DecoderShape):
    """A Qwen3-style decoder: an explicit ``head_dim`` (``heads·head_dim`` may differ
    from ``hidden``), RMSNorms over each query and key head (``q_norm``/``k_norm``,
    ``head_dim`` wide, on every TP rank), no q/k/v biases."""

    head_width: int = 0

    @property
    def head_dim(self) -> int:
        return self.head_width or self.hidden // self.heads

    def tensors(self) -> list[ParamTensor]:
        out: list[ParamTensor] = []
        h, hd = self.hidden, self.head_dim
        q, kv = self.heads * hd, self.kv_heads * hd
        for t in super().tensors():
            if t.name.endswith(("q_proj.weight", "o_proj.weight", "k_proj.weight", "v_proj.weight")):
                shape = {"q_proj": (q, h), "o_proj": (h, q)}.get(t.name.split(".")[-2], (kv, h))
                t = replace(t, shape=shape)
            out.append(t)
            if t.name.endswith("v_proj.weight"):
                p = t.name.removesuffix("v_proj.weight")
                out += [ParamTensor(p + "q_norm.weight", (hd,)), ParamTensor(p + "k_norm.weight", (hd,))]
        return out


def qwen3_decoder_shape(cfg: dict[str, Any]) -> QKNormDecoderShape:
    """A Qwen3 / Qwen3-VL text decoder from its ``config.json`` (or a whole VLM's ``text_config``)."""
    text = cfg.get("text_config") or cfg
    base = hf_decoder_shape(cfg)
    heads = config_int(text, "num_attention_heads")
    return QKNormDecoderShape(
        **{f.name: getattr(base, f.name) for f in fields(DecoderShape) if f.init},
        head_width=int(text.get("head_dim") or config_int(text, "hidden_size") // heads),
    )
