"""``internvl``: the language model inside an InternVL dir
(``InternVLForConditionalGeneration``: a Qwen2 or Llama decoder behind InternViT).

The decoder is transformers' own, so every LLM strategy runs it as it runs a Qwen2 or
Llama decoder (the layer map is the shared one); the tower and projector are dropped
unbuilt (the ``internvl`` vision family's group holds them). An image is spelled as
InternVL's processor spells it: ``<img>``, one ``<IMG_CONTEXT>`` per row, ``</img>``; a
video as ``Frame1: <img>...</img>`` and so on, one line per frame (a frame is one tile, its rows
at the same ``<IMG_CONTEXT>`` tokens, after the sample's images').
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from torch import nn

from disagg_llm_tp.families.base import HFDecoderFamily

#: decoders InternVL dirs ship (InternVL2.5/3: Qwen2 or InternLM2-as-Llama)
_DECODERS = ("qwen2", "llama")


class InternVLLanguageFamily(HFDecoderFamily):
    name: ClassVar[str] = "internvl"
    vlm_model_types: ClassVar[tuple[str, ...]] = ("internvl",)
    placeholder_tokens: ClassVar[dict[str, str]] = {"vision": "<IMG_CONTEXT>"}

    def hf_class(self) -> type:
        from transformers import InternVLForConditionalGeneration

        return InternVLForConditionalGeneration

    def prune(self, model: nn.Module) -> nn.Module:
        # The vision tower and projector belong to the vision module's group.
        model.model.vision_tower = None
        model.model.multi_modal_projector = None
        return model

    def check(self, strategy: str, degree: int, replicas: int) -> list[str]:
        problems = super().check(strategy, degree, replicas)
        if problems:
            return problems
        decoder = self.text_config.model_type
        if decoder not in _DECODERS:
            problems.append(
                f"text_config.model_type={decoder!r} in {self.path}/config.json: family 'internvl' runs "
                f"{' or '.join(_DECODERS)} decoders"
            )
        return problems

    def placeholder_text(self, module: str, n_tokens: int) -> str:
        return "<img>" + "<IMG_CONTEXT>" * n_tokens + "</img>"

    def video_token_id(self) -> int | None:
        # a video's frames are tiles: their rows go to the image tokens, after the images'
        return self.placeholder_token_id("vision")

    def video_placeholder_text(self, n_tokens: int, timestamps: list[float] | None = None) -> str:
        """``InternVLProcessor.replace_video_token``: one ``Frame{i}: <img>...</img>`` line per
        frame, each frame one tile of ``image_seq_length`` tokens."""
        per = self._tile_tokens()
        if n_tokens % per:
            raise ValueError(f"{n_tokens} video tokens are not whole tiles of {per}")
        frame = "<img>" + "<IMG_CONTEXT>" * per + "</img>"
        return "\n".join(f"Frame{i + 1}: {frame}" for i in range(n_tokens // per))

    def _tile_tokens(self) -> int:
        """LLM tokens of one tile: (tile side / patch · downsample_ratio)²."""
        v = self.config.vision_config
        side = int(v.image_size[0]) // int(v.patch_size[0])
        return round(side * float(self.config.downsample_ratio)) ** 2

    @classmethod
    def make_tiny(cls, out_dir: Path, tokenizer_dir: Path | None = None) -> Path:
        raise NotImplementedError("the internvl dir is written by the vision family's make_tiny")
