"""``qwen2``: Qwen2 / Qwen2.5 decoders (``Qwen2ForCausalLM`` dirs)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from disagg_llm_tp.families.base import HFDecoderFamily
from disagg_llm_tp.families.tiny import decoder_sizes, qwen_tokenizer, save_random


class Qwen2Family(HFDecoderFamily):
    name: ClassVar[str] = "qwen2"
    model_types: ClassVar[tuple[str, ...]] = ("qwen2",)
    placeholder_tokens: ClassVar[dict[str, str]] = {"vision": "<|image_pad|>", "audio": "<|AUDIO|>"}

    def hf_class(self) -> type:
        from transformers import Qwen2ForCausalLM

        return Qwen2ForCausalLM

    @classmethod
    def make_tiny(
        cls,
        out_dir: Path,
        tokenizer_dir: Path | None = None,
        *,
        vocab_size: int | None = None,
        tie_word_embeddings: bool = True,
        num_key_value_heads: int = 2,
        hidden_size: int = 64,
        seed: int = 0,
    ) -> Path:
        """A tiny Qwen2 dir: q/k/v biases, GQA (4 heads, 2 KV), tied embeddings
        by default; ``vocab_size`` may exceed the tokenizer (pick one not
        divisible by the degree to exercise vocabulary padding). ``hidden_size``
        lets a composed model match its encoders' projectors (a Qwen2.5-VL
        merger feeds an LLM of the width it was trained for)."""
        from transformers import Qwen2Config, Qwen2ForCausalLM

        out = Path(out_dir)
        tok = qwen_tokenizer(out)
        config = Qwen2Config(
            **decoder_sizes(
                vocab_size or len(tok), num_key_value_heads=num_key_value_heads, hidden_size=hidden_size
            ),
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        return save_random(Qwen2ForCausalLM, config, out, seed)
