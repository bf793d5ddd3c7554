"""``llama``: Llama decoders (``LlamaForCausalLM`` dirs) and the language model
inside a LLaVA dir (``LlavaForConditionalGeneration``; placeholder id =
``config.image_token_id``)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from torch import nn

from disagg_llm_tp.families.base import HFDecoderFamily
from disagg_llm_tp.families.tiny import decoder_sizes, llama_tokenizer, save_random


class LlamaFamily(HFDecoderFamily):
    name: ClassVar[str] = "llama"
    model_types: ClassVar[tuple[str, ...]] = ("llama",)
    vlm_model_types: ClassVar[tuple[str, ...]] = ("llava",)
    placeholder_tokens: ClassVar[dict[str, str]] = {"vision": "<image>", "audio": "<audio>"}

    def hf_class(self) -> type:
        from transformers import LlamaForCausalLM, LlavaForConditionalGeneration

        return LlavaForConditionalGeneration if self.is_vlm else LlamaForCausalLM

    def prune(self, model: nn.Module) -> nn.Module:
        if self.is_vlm:
            # The vision tower and projector belong to the vision module's group.
            model.model.vision_tower = None
            model.model.multi_modal_projector = None
        return model

    @classmethod
    def make_tiny(
        cls,
        out_dir: Path,
        tokenizer_dir: Path | None = None,
        *,
        vocab_size: int | None = None,
        tie_word_embeddings: bool = False,
        num_key_value_heads: int = 2,
        seed: int = 0,
    ) -> Path:
        """A tiny Llama dir: GQA (4 heads, 2 KV), untied embeddings by default."""
        from transformers import LlamaConfig, LlamaForCausalLM

        out = Path(out_dir)
        tok = llama_tokenizer(out)
        config = LlamaConfig(
            **decoder_sizes(vocab_size or len(tok), num_key_value_heads=num_key_value_heads),
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        return save_random(LlamaForCausalLM, config, out, seed)
