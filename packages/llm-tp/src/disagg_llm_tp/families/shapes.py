"""The LLM families' decoders as the cost hooks see them (``Family.planning_shape``)."""

from __future__ import annotations

from typing import Any

from disagg.interfaces.shapes import DecoderShape, decoder_shape


def hf_decoder_shape(cfg: dict[str, Any]) -> DecoderShape:
    """A Qwen2/Llama-style decoder from a decoder's ``config.json`` or a whole
    multimodal dir's ``text_config``; tied embeddings as the top level says."""
    text = cfg.get("text_config") or cfg
    tie = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return decoder_shape(text, tie)
