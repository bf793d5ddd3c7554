"""Module shapes the cost hooks read: numbers from a model's config, no weights.

A family describes its own module for planning (``Family.planning_shape``):
an :class:`EncoderShape` (a transformer tower: vision with or without attention
windows and a patch merger, an audio encoder, a CLIP tower with its projector)
or a :class:`DecoderShape` (a GQA decoder with SwiGLU MLPs: Qwen2, Llama).
Every parameter tensor is listed with how a tensor-parallel strategy may cut it
(``column``/``row``/``vocab``/``kv``/``replicated``) and how many rows of the
sequence its matmul sees, so state bytes, gradient-reduction bytes and dense
FLOPs are sums over real tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal

TPKind = Literal["column", "row", "vocab", "kv", "replicated"]


@dataclass(frozen=True)
class ParamTensor:
    name: str
    shape: tuple[int, ...]
    #: how a tensor-parallel strategy cuts it: column (dim 0, per chunk), row (dim 1),
    #: vocab (dim 0, padded), kv (a key/value projection: split by heads, or one whole
    #: head per rank when the heads do not divide the degree), or not at all
    tp: TPKind = "replicated"
    #: key/value heads of a ``kv`` tensor
    heads: int = 0
    #: ``(a, b)``: a weight of 2+ dims is applied to ``n·a // b`` rows of an ``n``-token
    #: sequence (a patch merger after a 2x2 merge: ``(1, 4)``; a convolution before a
    #: stride-2 one: ``(2, 1)``); 1-D tensors (norms, biases) do no matmul
    rows: tuple[int, int] = (1, 1)

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

    def matmul_rows(self, n: int) -> int:
        """Rows this weight multiplies in an ``n``-token sequence (0: no matmul)."""
        if len(self.shape) < 2:
            return 0
        return n * self.rows[0] // self.rows[1]


@dataclass(frozen=True)
class EncoderShape:
    """A transformer encoder tower as its family describes it: ``depth`` blocks
    (attention over windows of ``window_tokens`` except ``full_blocks``), an MLP of
    width ``intermediate``, an output stage (merger / projector) of width
    ``out_hidden`` producing one row per ``unit`` encoder tokens."""

    #: the family that described it (``qwen2_5_vl``, ``whisper``, ...)
    family: str
    hidden: int
    heads: int
    depth: int
    intermediate: int
    out_hidden: int
    #: blocks that attend over the whole sequence; the others attend within windows
    full_blocks: tuple[int, ...]
    #: every parameter tensor, in the module's order (see :class:`ParamTensor`)
    params: tuple[ParamTensor, ...] = field(default=(), compare=False, repr=False)
    #: input elements per encoder token (pixels of a patch, mel bins x conv taps)
    input_elems: int = 0
    #: patch side in pixels, spatial merge, attention window side in pixels (0: none):
    #: what a vision length sweep needs to make images of whole windows
    patch: int = 0
    merge: int = 1
    window: int = 0
    #: encoder tokens per output row where that is not a spatial merge (an audio
    #: tower's pooling); 0: ``merge²``
    pool: int = 0
    #: activations an MLP saves per token: ``mlp_in`` tensors of width ``hidden`` (its
    #: linears' inputs) and ``mlp_mid`` of width ``intermediate`` (SwiGLU: gate, its
    #: activation, up and their product = 4; GELU fc1/fc2: output, activation = 2)
    mlp_in: int = 2
    mlp_mid: int = 4
    #: elements the output stage saves per encoder token (a Qwen merger: ``6·hidden + 2``);
    #: 0 = ``6·hidden + 2``
    head_saves: int = 0
    kind: str = field(default="vision", init=False)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def unit(self) -> int:
        """Encoder tokens per output row (the spatial merge, or an audio pooling)."""
        return self.pool or self.merge * self.merge

    @property
    def window_tokens(self) -> int:
        """Encoder tokens in one attention window (``window`` px square); 0 without windows."""
        if not self.window or not self.patch:
            return 0
        side = self.window // self.patch
        return side * side

    @property
    def head_act(self) -> int:
        return self.head_saves or 6 * self.hidden + 2

    def window_index_bytes(self, tokens: int) -> int:
        """HF's windowed towers save the window permutation's index twice (int64 per merged row)."""
        return 2 * 8 * (tokens // self.unit) if self.window else 0

    def tensors(self) -> list[ParamTensor]:
        return list(self.params)


#: the name the cost code used before audio and CLIP towers were described
VisionShape = EncoderShape


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
        return list(_decoder_tensors(self))


Shape = EncoderShape | DecoderShape


@functools.lru_cache(maxsize=64)
def _decoder_tensors(s: DecoderShape) -> tuple[ParamTensor, ...]:
    """A 64-layer decoder lists ~900 tensors; a planner asks for them thousands of times."""
    h, i, hd = s.hidden, s.intermediate, s.head_dim
    q, kv = s.heads * hd, s.kv_heads * hd
    out = [ParamTensor("embed_tokens.weight", (s.vocab, h), "vocab")]
    for layer in range(s.layers):
        p = f"layers.{layer}."
        out += [
            ParamTensor(p + "q_proj.weight", (q, h), "column"),
            ParamTensor(p + "k_proj.weight", (kv, h), "kv", s.kv_heads),
            ParamTensor(p + "v_proj.weight", (kv, h), "kv", s.kv_heads),
        ]
        if s.qkv_bias:
            out += [
                ParamTensor(p + "q_proj.bias", (q,), "column"),
                ParamTensor(p + "k_proj.bias", (kv,), "kv", s.kv_heads),
                ParamTensor(p + "v_proj.bias", (kv,), "kv", s.kv_heads),
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
    if not s.tie_embeddings:
        out.append(ParamTensor("lm_head.weight", (s.vocab, h), "vocab"))
    return tuple(out)


def decoder_shape(text: dict, tie_embeddings: bool | None = None) -> DecoderShape:
    """A decoder's shape from its (text) config's values: Qwen2/Llama key names."""
    return DecoderShape(
        hidden=config_int(text, "hidden_size"),
        heads=config_int(text, "num_attention_heads"),
        kv_heads=int(text.get("num_key_value_heads") or text["num_attention_heads"]),
        layers=config_int(text, "num_hidden_layers"),
        intermediate=config_int(text, "intermediate_size"),
        vocab=config_int(text, "vocab_size"),
        tie_embeddings=bool(text.get("tie_word_embeddings", False))
        if tie_embeddings is None
        else tie_embeddings,
        qkv_bias=text.get("model_type", "qwen2").startswith("qwen"),
    )


def config_int(cfg: dict, *keys: str) -> int:
    """The first of ``keys`` in a config dict, as an int; a clear error naming them when none is."""
    for k in keys:
        if k in cfg:
            return int(cfg[k])
    raise ValueError(f"config key {' or '.join(keys)!r} is missing (have: {', '.join(sorted(cfg))})")
