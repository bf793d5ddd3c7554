"""``qwen2_vl`` vision family: the ``visual`` tower of a Qwen2-VL dir, merger included.

Qwen2-VL is Qwen2.5-VL without attention windows: every block attends over
the whole of each image (each frame), and the patches stay in processor order,
which already groups each 2x2 merge unit. Under ``ulysses`` every block spans
shards, and cuts may fall on any merge-unit boundary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from disagg.interfaces import SeqLayout
from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision


class Qwen2VLVision(Qwen2_5_VLVision):
    """Options: ``attn_implementation`` (sdpa | eager | flash_attention_2)."""

    name: ClassVar[str] = "qwen2_vl"

    @classmethod
    def planning_shape(cls, config, options=None, llm_hidden=None):  # type: ignore[no-untyped-def]
        from disagg_vision_sp.families.shapes import qwen2_vl_shape

        return qwen2_vl_shape(config)

    model_types: ClassVar[tuple[str, ...]] = ("qwen2_vl",)
    #: video as Qwen2.5-VL's (the same sampling, grid and patch layout: transformers'
    #: Qwen2VLVideoProcessor serves both)
    reads_video: ClassVar[bool] = True

    def hidden_size(self) -> int:
        # Qwen2-VL's vision config calls the merger's output width hidden_size.
        return int(self.vision_config().hidden_size)

    def tower_class(self) -> type:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return Qwen2VisionTransformerPretrainedModel

    mlp_column: ClassVar[tuple[str, ...]] = ("fc1",)
    mlp_row: ClassVar[str] = "fc2"

    @classmethod
    def make_tiny(cls, out_dir: Path, tokenizer_dir: Path | None = None) -> Path:
        from disagg_vision_sp.families.tiny_qwen2_5_vl import make_tiny_qwen2_vl

        return make_tiny_qwen2_vl(Path(out_dir))

    @classmethod
    def tiny_variants(cls) -> dict[str, Any]:
        return {}  # the benchmark's deep tower is Qwen2.5-VL's only (Qwen3-VL inherits this)

    # -- ulysses hook points --------------------------------------------------------------------
    def ulysses_layout(self, inputs: list[dict[str, torch.Tensor]]) -> SeqLayout:
        from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

        merge = int(self.vision_config().spatial_merge_size)
        unit = merge * merge
        grid = torch.cat([self.grid(x) for x in inputs])  # images, then videos, per sample
        full_cu = get_vision_cu_seqlens(grid)
        n = int(full_cu[-1])
        sample_rows = [sum(self.num_tokens(x)) for x in inputs]
        starts = torch.tensor([0] + sample_rows).cumsum(0)
        rows = torch.arange(n // unit)
        row_sample = torch.searchsorted(starts, rows, right=True) - 1
        return SeqLayout(
            n_tokens=n,
            cuts=list(range(0, n + 1, unit)),
            unit=unit,
            row_sample=row_sample,
            row_pos=rows - starts[row_sample],
            sample_rows=sample_rows,
            extra={
                "full_segments": (full_cu[1:] - full_cu[:-1]).tolist(),
                "position_ids": get_vision_position_ids(grid, merge),
            },
        )

    def embed(
        self, module: nn.Module, inputs: list[dict[str, torch.Tensor]], layout: SeqLayout, lo: int, hi: int
    ) -> tuple[torch.Tensor, Any]:
        """Patch embeddings and rotary embeddings of tokens ``[lo, hi)`` (both per token)."""
        pixels = torch.cat([self.pixels(x) for x in inputs])[lo:hi].to(module.device, module.dtype)
        hidden = module.patch_embed(pixels)
        return hidden, module.rotary_pos_emb(hidden, layout.extra["position_ids"][lo:hi].to(module.device))

    def full_blocks(self, module: nn.Module) -> set[int]:
        return set(range(len(module.blocks)))  # no attention windows
