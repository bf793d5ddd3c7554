"""Qwen3.5's hybrid decoder as the cost hooks see it (``Qwen35LanguageFamily.planning_shape``).

Every parameter tensor of the real model is listed under its own name and
shape, layer by layer as ``text_config.layer_types`` orders them: gated
full-attention layers (``q_proj`` twice as wide, its second half the output
gate; per-head ``q_norm``/``k_norm``) and gated-delta-net layers (fused
``in_proj_qkv``, ``in_proj_z``/``b``/``a``, a depthwise causal ``conv1d`` over
the q/k/v channels, per-value-head ``dt_bias``/``A_log``, a gated RMSNorm over
each value head and ``out_proj``), so state bytes and matmul FLOPs per token
are the model's. The attention-score terms the cost rules add per layer are
softmax attention's for every layer (a linear layer's chunked recurrence costs
less at long sequences): an upper bound there, stated, not hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from disagg.interfaces.shapes import DecoderShape, ParamTensor, config_int
from disagg_llm_tp.families.shapes import QKNormDecoderShape, hf_decoder_shape


@dataclass(frozen=True)
class HybridDecoderShape(QKNormDecoderShape):
    """``layer_types``: ``"linear_attention"`` / ``"full_attention"`` per layer; ``linear``:
    (key heads, value heads, key head dim, value head dim, conv kernel)."""

    layer_types: tuple[str, ...] = ()
    linear: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)

    def tensors(self) -> list[ParamTensor]:
        h, hd, i = self.hidden, self.head_dim, self.intermediate
        kh, vh, kd, vd, kernel = self.linear
        q, kv, keys, values = self.heads * hd, self.kv_heads * hd, kh * kd, vh * vd
        out = [ParamTensor("embed_tokens.weight", (self.vocab, h), "vocab")]
        for layer, kind in enumerate(self.layer_types):
            p = f"layers.{layer}."
            if kind == "full_attention":
                a = p + "self_attn."
                out += [
                    ParamTensor(a + "q_proj.weight", (2 * q, h), "column"),  # queries and their gate
                    ParamTensor(a + "k_proj.weight", (kv, h), "kv", self.kv_heads),
                    ParamTensor(a + "v_proj.weight", (kv, h), "kv", self.kv_heads),
                    ParamTensor(a + "o_proj.weight", (h, q), "row"),
                    ParamTensor(a + "q_norm.weight", (hd,)),
                    ParamTensor(a + "k_norm.weight", (hd,)),
                ]
                if self.qkv_bias:  # attention_bias: q/k/v/o all biased
                    out += [
                        ParamTensor(a + "q_proj.bias", (2 * q,), "column"),
                        ParamTensor(a + "k_proj.bias", (kv,), "kv", self.kv_heads),
                        ParamTensor(a + "v_proj.bias", (kv,), "kv", self.kv_heads),
                        ParamTensor(a + "o_proj.bias", (h,)),
                    ]
            else:
                a = p + "linear_attn."
                conv = 2 * keys + values
                out += [
                    ParamTensor(a + "in_proj_qkv.weight", (conv, h), "column"),
                    ParamTensor(a + "in_proj_z.weight", (values, h), "column"),
                    ParamTensor(a + "in_proj_b.weight", (vh, h), "column"),
                    ParamTensor(a + "in_proj_a.weight", (vh, h), "column"),
                    ParamTensor(a + "conv1d.weight", (conv, 1, kernel), "column"),
                    ParamTensor(a + "dt_bias", (vh,), "column"),
                    ParamTensor(a + "A_log", (vh,), "column"),
                    ParamTensor(a + "norm.weight", (vd,)),
                    ParamTensor(a + "out_proj.weight", (h, values), "row"),
                ]
            out += [
                ParamTensor(p + "mlp.gate_proj.weight", (i, h), "column"),
                ParamTensor(p + "mlp.up_proj.weight", (i, h), "column"),
                ParamTensor(p + "mlp.down_proj.weight", (h, i), "row"),
                ParamTensor(p + "input_layernorm.weight", (h,)),
                ParamTensor(p + "post_attention_layernorm.weight", (h,)),
            ]
        out.append(ParamTensor("norm.weight", (h,)))
        if not self.tie_embeddings:
            out.append(ParamTensor("lm_head.weight", (self.vocab, h), "vocab"))
        return out


def qwen3_5_decoder_shape(cfg: dict[str, Any]) -> HybridDecoderShape:
    """From a whole Qwen3.5 dir's ``config.json`` (or its ``text_config``). Layer kinds as
    ``Qwen3_5TextConfig`` sets them: ``layer_types`` when given, else every
    ``full_attention_interval``-th layer (4 by default) full, the rest linear."""
    text = cfg.get("text_config") or cfg
    # Qwen3_5TextConfig's attention_bias defaults to False (not Qwen2's always-biased q/k/v)
    base = replace(hf_decoder_shape(cfg), qkv_bias=bool(text.get("attention_bias", False)))
    heads, layers = config_int(text, "num_attention_heads"), config_int(text, "num_hidden_layers")
    kinds = text.get("layer_types")
    if kinds is None:
        every = int(text.get("full_attention_interval", 4))
        kinds = ["linear_attention" if (n + 1) % every else "full_attention" for n in range(layers)]
    if len(kinds) != layers or set(kinds) - {"linear_attention", "full_attention"}:
        raise ValueError(
            f"text_config.layer_types must list {layers} entries of 'linear_attention' or "
            f"'full_attention', got {kinds!r}"
        )
    linear = (
        int(text.get("linear_num_key_heads", 16)),
        int(text.get("linear_num_value_heads", 32)),
        int(text.get("linear_key_head_dim", 128)),
        int(text.get("linear_value_head_dim", 128)),
        int(text.get("linear_conv_kernel_dim", 4)),
    )
    return HybridDecoderShape(
        **{f.name: getattr(base, f.name) for f in fields(DecoderShape) if f.init},
        head_width=int(text.get("head_dim") or config_int(text, "hidden_size") // heads),
        layer_types=tuple(kinds),
        linear=linear,
    )
