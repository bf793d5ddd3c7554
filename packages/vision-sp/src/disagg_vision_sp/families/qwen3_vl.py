"""``qwen3_vl`` vision family: the ``visual`` tower of a Qwen3-VL dir, its
mergers included.

Qwen3-VL's tower (``Qwen3VLVisionModel``) returns, beside the merged image
embeddings (``pooler_output``), DeepStack features: the outputs of one more
merger per layer in ``deepstack_visual_indexes``, each one row per image
token, which the LLM adds to its hidden states at the image positions after
its first layers. They fit the embedding exchange as extra columns: ``encode``
returns ``[main | deepstack_0 | ... | deepstack_{K-1}]`` rows, ``(1 + K) x``
the LLM width (``hidden_size()`` reports that width), routed per row like any
embedding; the ``qwen3_vl`` LLM family splits the columns again. Attention is
as Qwen2-VL's (whole images, no windows); the learned position embedding is
resampled per token, so each shard computes only its own tokens'.

Video follows transformers' ``Qwen3VLVideoProcessor`` (its frame sampling,
its ``smart_resize`` over the whole video, :func:`qwen3_video_inputs`); a
sample's videos go through the tower after its images, each temporal patch
attending on its own as in HF's call, and the DeepStack columns come along.
The prompt's per-frame timestamps are the ``qwen3_vl`` LLM family's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from disagg.interfaces import LayerMap, SeqLayout
from disagg_vision_sp.families.qwen2_vl import Qwen2VLVision


class Qwen3VLVision(Qwen2VLVision):
    """Options: ``attn_implementation`` (sdpa | eager | flash_attention_2)."""

    name: ClassVar[str] = "qwen3_vl"

    @classmethod
    def planning_shape(cls, config, options=None, llm_hidden=None):  # type: ignore[no-untyped-def]
        from disagg_vision_sp.families.shapes import qwen3_vl_shape

        return qwen3_vl_shape(config)

    model_types: ClassVar[tuple[str, ...]] = ("qwen3_vl",)
    #: Qwen3-VL's video: its own sampling and resize; timestamps are the LLM family's
    reads_video: ClassVar[bool] = True
    video_sampling: ClassVar[str] = "qwen3_vl"

    def deepstack_layers(self) -> int:
        return len(self.vision_config().deepstack_visual_indexes)

    def hidden_size(self) -> int:
        # main rows and one block of columns per DeepStack merger
        return int(self.vision_config().out_hidden_size) * (1 + self.deepstack_layers())

    def tower_class(self) -> type:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel

    def layer_map(self) -> LayerMap:
        # a tower without DeepStack (Qwen3.5's) has the main merger only
        mergers = ("merger", "deepstack_merger_list.*") if self.deepstack_layers() else ("merger",)
        return LayerMap(
            column=("blocks.*.attn.qkv", "blocks.*.mlp.linear_fc1", *(f"{m}.linear_fc1" for m in mergers)),
            row=("blocks.*.attn.proj", "blocks.*.mlp.linear_fc2", *(f"{m}.linear_fc2" for m in mergers)),
            heads={"blocks.*.attn": ("num_heads",)},
            column_chunks={"blocks.*.attn.qkv": 3},
            # No sequence-parallel regions: a DeepStack merger norms 2x2-merged rows
            # taken straight from the residual stream.
            replicated=(
                "patch_embed.*",
                "pos_embed.*",
                "blocks.*.norm1.*",
                "blocks.*.norm2.*",
                *(f"{m}.norm.*" for m in mergers),
            ),
        )

    def parts(self) -> dict[str, tuple[str, ...]]:
        parts = {
            "tower": ("patch_embed.*", "pos_embed.*", "blocks.*"),
            "patch_embed": ("patch_embed.*", "pos_embed.*"),
            "blocks": ("blocks.*",),
            "merger": ("merger.*",),
        }
        if self.deepstack_layers():
            parts["deepstack_mergers"] = ("deepstack_merger_list.*",)
        return parts

    @classmethod
    def make_tiny(cls, out_dir: Path, tokenizer_dir: Path | None = None) -> Path:
        from disagg_vision_sp.families.tiny_qwen2_5_vl import make_tiny_qwen3_vl

        return make_tiny_qwen3_vl(Path(out_dir))

    def preprocess_video(self, videos: list[Any], **limits: int) -> dict[str, torch.Tensor]:
        from disagg_vision_sp.families.common import image_processor
        from disagg_vision_sp.families.qwen_video import qwen3_video_inputs

        cfg = self.vision_config()
        return qwen3_video_inputs(
            videos,
            image_processor(str(self.path)),
            patch=int(cfg.patch_size),
            merge=int(cfg.spatial_merge_size),
            temporal=int(cfg.temporal_patch_size),
            **limits,
        )

    # -- forward ----------------------------------------------------------------------------------
    def encode(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        # images, then videos: each grid attends on its own, so one call equals HF's two
        pixels = self.pixels(inputs).to(module.device, module.dtype)
        out = module(pixels, grid_thw=self.grid(inputs).to(module.device))
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)

    def ulysses_layout(self, inputs: list[dict[str, torch.Tensor]]) -> SeqLayout:
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        layout = super().ulysses_layout(inputs)
        cfg = self.vision_config()
        grid = torch.cat([self.grid(x) for x in inputs])  # images, then videos, per sample
        # Qwen3VLVisionModel's resampling settings (bilinear, corners aligned), per token
        side = int(cfg.num_position_embeddings**0.5)
        idx, w = get_vision_interpolation_indices_and_weights(
            grid, num_grid_per_side=side, mode="bilinear", align_corners=True,
            spatial_merge_size=int(cfg.spatial_merge_size),
        )  # fmt: skip
        layout.extra.update(interp_indices=idx, interp_weights=w)
        return layout

    def embed(
        self, module: nn.Module, inputs: list[dict[str, torch.Tensor]], layout: SeqLayout, lo: int, hi: int
    ) -> tuple[torch.Tensor, Any]:
        pixels = torch.cat([self.pixels(x) for x in inputs])[lo:hi].to(module.device, module.dtype)
        hidden = module.patch_embed(pixels)
        idx = layout.extra["interp_indices"][lo:hi].to(module.device)
        w = layout.extra["interp_weights"][lo:hi].to(module.device)
        hidden = hidden + (module.pos_embed(idx) * w[:, :, None]).sum(1).to(hidden.dtype)
        return hidden, module.rotary_pos_emb(hidden, layout.extra["position_ids"][lo:hi].to(module.device))

    def tapped_blocks(self, module: nn.Module) -> tuple[int, ...]:
        return tuple(module.deepstack_visual_indexes)

    def merge(self, module: nn.Module, hidden: torch.Tensor, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        # one DeepStack merger per tapped block, in block order (as HF's forward)
        indexes = list(module.deepstack_visual_indexes)
        deepstack = [module.deepstack_merger_list[indexes.index(i)](taps[i]) for i in sorted(taps)]
        return torch.cat([module.merger(hidden), *deepstack], dim=-1)
