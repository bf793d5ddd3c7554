"""``qwen3_5`` vision family: the ``visual`` tower of a Qwen3.5 dir, its merger included.

Qwen3.5's tower (``Qwen3_5VisionModel``) is Qwen3-VL's without DeepStack: the
same patch embedding, learned position grid resampled per token, full
attention over each image in every block and 2x2 merger, and it returns only
the merged embeddings (``pooler_output``), one row per image token at the
LLM's width. So everything Qwen3-VL's family does under ``ulysses`` (each
shard resamples only its own tokens' positions) holds with no tapped blocks.
Video is Qwen3-VL's too (its sampling, whole-video resize, a sample's videos
after its images); the prompt's timestamps are the ``qwen3_5`` LLM family's.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from disagg_vision_sp.families.qwen3_vl import Qwen3VLVision


class Qwen3_5Vision(Qwen3VLVision):
    """Options: ``attn_implementation`` (sdpa | eager | flash_attention_2)."""

    name: ClassVar[str] = "qwen3_5"
    model_types: ClassVar[tuple[str, ...]] = ("qwen3_5",)
    # video: Qwen3-VL's (inherited reads_video / video_sampling / preprocess_video; Qwen3.5
    # dirs ship Qwen3VLProcessor and Qwen3VLVideoProcessor, no processor of their own)

    @classmethod
    def planning_shape(cls, config, options=None, llm_hidden=None):  # type: ignore[no-untyped-def]
        from dataclasses import replace

        from disagg_vision_sp.families.shapes import qwen3_vl_shape

        # Qwen3-VL's tower with no DeepStack merger (a published config may say so with
        # "deepstack_visual_indexes": [], or leave the key out)
        vision = dict(config.get("vision_config") or config)
        vision["deepstack_visual_indexes"] = []
        return replace(qwen3_vl_shape(vision), family=cls.name)

    def deepstack_layers(self) -> int:
        return 0

    def tower_class(self) -> type:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        return Qwen3_5VisionModel

    @classmethod
    def make_tiny(cls, out_dir: Path, tokenizer_dir: Path | None = None) -> Path:
        from disagg_vision_sp.families.tiny_qwen3_5 import make_tiny_qwen3_5

        return make_tiny_qwen3_5(Path(out_dir))

    def encode(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        # images, then videos: each grid attends on its own, so one call equals HF's two
        pixels = self.pixels(inputs).to(module.device, module.dtype)
        return module(pixels, grid_thw=self.grid(inputs).to(module.device)).pooler_output

    def tapped_blocks(self, module: nn.Module) -> tuple[int, ...]:
        return ()

    def merge(self, module: nn.Module, hidden: torch.Tensor, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        return module.merger(hidden)
