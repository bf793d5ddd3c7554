"""``qwen2_vl`` (role llm): the language model and ``lm_head`` inside a whole
Qwen2-VL dir. Qwen2-VL's decoder, mRoPE and placeholders are Qwen2.5-VL's
(the towers differ, and the vision group owns the tower)."""

from __future__ import annotations

from typing import ClassVar

import torch

from disagg_llm_tp.families.qwen2_5_vl import Qwen25VLLanguageFamily


class Qwen2VLLanguageFamily(Qwen25VLLanguageFamily):
    #: video rows at ``<|video_pad|>``; Qwen2-VL's mRoPE time axis counts temporal patches
    #: (no ``second_per_grid_ts``: its ``get_rope_index`` has none)
    takes_video: ClassVar[bool] = True
    #: its forward is not split yet (its own positions/run are untested under context parallelism)
    context_parallel_support: ClassVar[bool] = False

    name: ClassVar[str] = "qwen2_vl"
    vlm_model_types: ClassVar[tuple[str, ...]] = ("qwen2_vl",)

    def video_inputs(
        self, ids: torch.Tensor, inputs: list[dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        out = super().video_inputs(ids, inputs)
        out.pop("second_per_grid_ts", None)
        return out

    @classmethod
    def hf_classes(cls) -> tuple[type, type]:
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        return Qwen2VLConfig, Qwen2VLForConditionalGeneration

    @classmethod
    def tiny_vision(cls, out_hidden: int) -> dict:
        return dict(
            depth=2,
            embed_dim=32,
            mlp_ratio=2,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            hidden_size=out_hidden,
        )
