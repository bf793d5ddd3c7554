"""Model shapes the cost formulas need, read from a Hugging Face config's values.

Only numbers: no weights, no download. :func:`shapes_from_hf_config` accepts a
whole-VLM ``config.json`` (``vision_config`` + ``text_config``, as Qwen2.5-VL
writes it) or the dict of one tower. Every parameter tensor is listed with how
``megatron_tp`` cuts it (``column``/``row``/``vocab``/``replicated``), so state
bytes and gradient-reduction bytes per rank are exact sums over real tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Literal

TPKind = Literal["column", "row", "vocab", "kv", "replicated"]


@dataclass(frozen=True)
class ParamTensor:
    name: str
    shape: tuple[int, ...]
    #: how megatron_tp cuts it: column (dim 0, per chunk), row (dim 1), vocab (dim 0, padded),
    #: kv (a key/value projection: split by heads, or one whole head per rank when the
    #: heads do not divide the degree), or not at all
    tp: TPKind = "replicated"
    #: key/value heads of a ``kv`` tensor
    heads: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def local_numel(self, degree: int) -> int:
        """Elements one tensor-parallel rank holds (the vocabulary is padded to a multiple of degree)."""
        if self.tp == "replicated" or degree == 1:
            return self.numel
        rest = self.numel // self.shape[0]
        if self.tp == "vocab":
            return -(-self.shape[0] // degree) * rest
        if self.tp == "kv" and self.heads % degree:
            return self.numel // self.heads
        return self.numel // degree


@dataclass(frozen=True)
class VisionShape:
    """A Qwen2.5-VL style vision tower: patch embedding, ``depth`` blocks (window
    attention except ``full_blocks``), RMSNorms, SwiGLU MLP, a 2x2 patch merger."""

    hidden: int
    heads: int
    depth: int
    intermediate: int
    out_hidden: int
    patch: int
    temporal_patch: int
    merge: int
    window: int
    full_blocks: tuple[int, ...]
    in_channels: int = 3
    kind: str = field(default="vision", init=False)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def unit(self) -> int:
        """Encoder tokens per output row (the spatial merge)."""
        return self.merge * self.merge

    @property
    def window_tokens(self) -> int:
        """Encoder tokens in one attention window (window_size px square)."""
        side = self.window // self.patch
        return side * side

    def tensors(self) -> list[ParamTensor]:
        return list(_cached_tensors(self))

    def _tensors(self) -> list[ParamTensor]:
        h, i, m = self.hidden, self.intermediate, self.hidden * self.unit
        out = [
            ParamTensor(
                "patch_embed.proj.weight", (h, self.in_channels, self.temporal_patch, self.patch, self.patch)
            )
        ]
        for b in range(self.depth):
            p = f"blocks.{b}."
            out += [
                ParamTensor(p + "norm1.weight", (h,)),
                ParamTensor(p + "norm2.weight", (h,)),
                ParamTensor(p + "attn.qkv.weight", (3 * h, h), "column"),
                ParamTensor(p + "attn.qkv.bias", (3 * h,), "column"),
                ParamTensor(p + "attn.proj.weight", (h, h), "row"),
                ParamTensor(p + "attn.proj.bias", (h,)),
                ParamTensor(p + "mlp.gate_proj.weight", (i, h), "column"),
                ParamTensor(p + "mlp.gate_proj.bias", (i,), "column"),
                ParamTensor(p + "mlp.up_proj.weight", (i, h), "column"),
                ParamTensor(p + "mlp.up_proj.bias", (i,), "column"),
                ParamTensor(p + "mlp.down_proj.weight", (h, i), "row"),
                ParamTensor(p + "mlp.down_proj.bias", (h,)),
            ]
        out += [
            ParamTensor("merger.ln_q.weight", (h,)),
            ParamTensor("merger.mlp.0.weight", (m, m), "column"),
            ParamTensor("merger.mlp.0.bias", (m,), "column"),
            ParamTensor("merger.mlp.2.weight", (self.out_hidden, m), "row"),
            ParamTensor("merger.mlp.2.bias", (self.out_hidden,)),
        ]
        return out


@dataclass(frozen=True)
class DecoderShape:
    """A Qwen2/Llama style decoder: embeddings, ``layers`` of GQA attention and
    SwiGLU MLP with RMSNorms, a final norm and an output layer."""

    hidden: int
    heads: int
    kv_heads: int
    layers: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False
    qkv_bias: bool = True
    kind: str = field(default="llm", init=False)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> list[ParamTensor]:
        return list(_cached_tensors(self))

    def _tensors(self) -> list[ParamTensor]:
        h, i, hd = self.hidden, self.intermediate, self.head_dim
        q, kv = self.heads * hd, self.kv_heads * hd
        out = [ParamTensor("embed_tokens.weight", (self.vocab, h), "vocab")]
        for layer in range(self.layers):
            p = f"layers.{layer}."
            out += [
                ParamTensor(p + "q_proj.weight", (q, h), "column"),
                ParamTensor(p + "k_proj.weight", (kv, h), "kv", self.kv_heads),
                ParamTensor(p + "v_proj.weight", (kv, h), "kv", self.kv_heads),
            ]
            if self.qkv_bias:
                out += [
                    ParamTensor(p + "q_proj.bias", (q,), "column"),
                    ParamTensor(p + "k_proj.bias", (kv,), "kv", self.kv_heads),
                    ParamTensor(p + "v_proj.bias", (kv,), "kv", self.kv_heads),
                ]
            out += [
                ParamTensor(p + "o_proj.weight", (h, q), "row"),
                ParamTensor(p + "gate_proj.weight", (i, h), "column"),
                ParamTensor(p + "up_proj.weight", (i, h), "column"),
                ParamTensor(p + "down_proj.weight", (h, i), "row"),
                ParamTensor(p + "input_layernorm.weight", (h,)),
                ParamTensor(p + "post_attention_layernorm.weight", (h,)),
            ]
        out.append(ParamTensor("norm.weight", (h,)))
        if not self.tie_embeddings:
            out.append(ParamTensor("lm_head.weight", (self.vocab, h), "vocab"))
        return out


Shape = VisionShape | DecoderShape


@functools.lru_cache(maxsize=64)
def _cached_tensors(shape: Shape) -> tuple[ParamTensor, ...]:
    """A 64-layer decoder lists ~900 tensors; a planner asks for them thousands of times."""
    return tuple(shape._tensors())


def shapes_from_hf_config(cfg: dict[str, Any]) -> dict[str, Shape]:
    """``{"vision": VisionShape, "llm": DecoderShape}`` (whichever the dict
    describes) from a config.json's values; a missing key is a clear error."""
    out: dict[str, Shape] = {}
    vision = cfg.get("vision_config") or (cfg if "fullatt_block_indexes" in cfg else None)
    if vision is not None:
        out["vision"] = VisionShape(
            hidden=_get(vision, "hidden_size", "embed_dim"),
            heads=_get(vision, "num_heads"),
            depth=_get(vision, "depth"),
            intermediate=_get(vision, "intermediate_size"),
            out_hidden=_get(vision, "out_hidden_size"),
            patch=_get(vision, "patch_size", "spatial_patch_size"),
            temporal_patch=_get(vision, "temporal_patch_size"),
            merge=_get(vision, "spatial_merge_size"),
            window=_get(vision, "window_size"),
            full_blocks=tuple(vision["fullatt_block_indexes"]),
            in_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
        )
    text = cfg.get("text_config") or (cfg if "num_hidden_layers" in cfg else None)
    if text is not None:
        out["llm"] = DecoderShape(
            hidden=_get(text, "hidden_size"),
            heads=_get(text, "num_attention_heads"),
            kv_heads=int(text.get("num_key_value_heads") or text["num_attention_heads"]),
            layers=_get(text, "num_hidden_layers"),
            intermediate=_get(text, "intermediate_size"),
            vocab=_get(text, "vocab_size"),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            qkv_bias=text.get("model_type", "qwen2").startswith("qwen"),
        )
    if not out:
        raise ValueError(
            "config has neither a vision tower (vision_config / fullatt_block_indexes) "
            "nor a decoder (text_config / num_hidden_layers)"
        )
    return out


def _get(cfg: dict[str, Any], *keys: str) -> int:
    for k in keys:
        if k in cfg:
            return int(cfg[k])
    raise ValueError(f"config key {' or '.join(keys)!r} is missing (have: {', '.join(sorted(cfg))})")
