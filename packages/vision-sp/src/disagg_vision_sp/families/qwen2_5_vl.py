"""``qwen2_5_vl`` vision family: the ``visual`` tower of a Qwen2.5-VL dir, merger included.

``encode`` is the unpartitioned HF forward. ``ulysses_forward`` runs the same
HF submodules on a slice of the window-permuted sequence: patch embedding and
rotary embeddings are per token, window blocks are local because cuts fall on
window boundaries, full-attention blocks span shards, and the merger sees
whole 2x2 merge units because windows are made of them.

Videos go through the same tower (:mod:`disagg_vision_sp.families.qwen_video`):
a sample's inputs may hold ``pixel_values``/``image_grid_thw`` and
``pixel_values_videos``/``video_grid_thw``; the tower sees the image patches
then the video patches (each grid attends on its own, so this equals HF's two
calls) and its rows come out in that order. A long video is split over the
Ulysses ranks like a long image.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from disagg.interfaces import (
    AttentionScope,
    EncoderFamily,
    LayerMap,
    SeqLayout,
    SequenceParallelRegions,
    UlyssesFamily,
)
from disagg.kit.hf import (
    check_attn_implementation,
    checkpoint_keys,
    empty_from_config,
    find_prefix,
    quiet_transformers,
)
from disagg_vision_sp.families.common import check_model_type, image_processor, load_image
from disagg_vision_sp.ulysses.attention import LENGTHS_KWARG

#: where the tower lives in the files of a whole-VLM dir (legacy and transformers-5 layouts)
_PREFIXES = ("visual.", "model.visual.", "")


class Qwen2_5_VLVision(UlyssesFamily, EncoderFamily):
    """Options: ``attn_implementation`` (sdpa | eager | flash_attention_2)."""

    name: ClassVar[str] = "qwen2_5_vl"

    @classmethod
    def planning_shape(cls, config, options=None, llm_hidden=None):  # type: ignore[no-untyped-def]
        from disagg_vision_sp.families.shapes import qwen2_5_vl_shape

        return qwen2_5_vl_shape(config)

    modality: ClassVar[str] = "image"
    pixel_limits: ClassVar[bool] = True
    reads_video: ClassVar[bool] = True
    #: ``model_type`` of the dirs this family reads (whole VLM)
    model_types: ClassVar[tuple[str, ...]] = ("qwen2_5_vl",)

    # -- config ---------------------------------------------------------------------------------
    def vision_config(self) -> Any:
        cfg = self.hf_config()
        # A whole-VLM dir nests it; a vision-only dir is it.
        return getattr(cfg, "vision_config", cfg)

    def hidden_size(self) -> int:
        return int(self.vision_config().out_hidden_size)

    def check(self, strategy: str, degree: int, replicas: int) -> list[str]:
        problems = check_model_type(self.path, self.name, self.model_types)
        return problems + check_attn_implementation(self.options, "vision")

    # -- building -------------------------------------------------------------------------------
    def tower_class(self) -> type:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        return Qwen2_5_VisionTransformerPretrainedModel

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        # Load only the tower's tensors, whatever dir layout: key_mapping strips the prefix.
        with quiet_transformers():
            return self.tower_class().from_pretrained(
                self.path,
                config=self.vision_config(),
                key_mapping={r"^model\.visual\.": "", r"^visual\.": ""},
                dtype=dtype,
                attn_implementation=self.options.get("attn_implementation", "sdpa"),
            )

    def build_empty(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """``build()``'s tower on the meta device: ``megatron_tp`` reads only its own slices."""
        attn = self.options.get("attn_implementation", "sdpa")
        return empty_from_config(
            self.tower_class(), self.vision_config(), dtype=dtype, attn_implementation=attn
        )

    def checkpoint_name(self, name: str) -> str:
        # the inverse of build()'s key_mapping: the dir's own prefix for the tower
        if getattr(self, "_prefix", None) is None:
            self._prefix = find_prefix(checkpoint_keys(self.path), "patch_embed.proj.weight", _PREFIXES)
        return self._prefix + name

    #: the blocks' MLP linears split along output / input features (Qwen2-VL names them fc1/fc2)
    mlp_column: ClassVar[tuple[str, ...]] = ("gate_proj", "up_proj")
    mlp_row: ClassVar[str] = "down_proj"

    def layer_map(self) -> LayerMap:
        mlp_row = f"blocks.*.mlp.{self.mlp_row}"
        return LayerMap(
            column=("blocks.*.attn.qkv", *(f"blocks.*.mlp.{c}" for c in self.mlp_column), "merger.mlp.0"),
            row=("blocks.*.attn.proj", mlp_row, "merger.mlp.2"),
            heads={"blocks.*.attn": ("num_heads",)},
            # qkv is one Linear whose output is [3, heads, head_dim]: split each of the 3 blocks.
            column_chunks={"blocks.*.attn.qkv": 3},
            # Full copies on every TP rank: the per-patch embedding and the norms.
            replicated=("patch_embed.*", "blocks.*.norm1.*", "blocks.*.norm2.*", "merger.ln_q.*"),
            # Sequence parallelism over the patches of the blocks' residual stream; the
            # merger's norm leaves it, since merging groups neighbouring patches.
            sequence_parallel=SequenceParallelRegions(
                split=("blocks.0",),
                gather=("blocks.*.norm1", "blocks.*.norm2", "merger.ln_q"),
                reduce_scatter=("blocks.*.attn.proj", mlp_row),
            ),
            # each block's MLP reads norm2's output only (parallel.vision.mlp_tiles)
            mlp={"blocks.*.mlp": "norm2"},
        )

    def parts(self) -> dict[str, tuple[str, ...]]:
        # "tower": everything before the merger (the usual recipe freezes it and trains the merger).
        return {
            "tower": ("patch_embed.*", "blocks.*"),
            "patch_embed": ("patch_embed.*",),
            "blocks": ("blocks.*",),
            "merger": ("merger.*",),
        }

    def export_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.checkpoint_name(k): v for k, v in state.items()}

    @classmethod
    def make_tiny(cls, out_dir: Path, tokenizer_dir: Path | None = None) -> Path:
        from disagg_vision_sp.families.tiny_qwen2_5_vl import make_tiny_qwen2_5_vl

        return make_tiny_qwen2_5_vl(Path(out_dir))

    @classmethod
    def tiny_variants(cls) -> dict[str, Any]:
        from disagg_vision_sp.families.tiny_qwen2_5_vl import VISION_DEEP, make_tiny_qwen2_5_vl

        # the benchmark's model (examples/bench/bench.yaml): an 8-block tower
        return {"qwen2_5_vl_deep": lambda out: make_tiny_qwen2_5_vl(Path(out), vision=VISION_DEEP)}

    # -- data -----------------------------------------------------------------------------------
    def preprocess(self, media: list[Any], **limits: int) -> dict[str, torch.Tensor]:
        # min_pixels/max_pixels: the area each image is resized to, so its token count
        proc = image_processor(str(self.path), **limits)
        out = proc(images=[load_image(m) for m in media], return_tensors="pt")
        return {
            "pixel_values": out["pixel_values"].to(torch.float32),
            "image_grid_thw": out["image_grid_thw"].to(torch.long),
        }

    def video_frame_factor(self) -> int:
        return int(self.vision_config().temporal_patch_size)

    def preprocess_video(self, videos: list[Any], **limits: int) -> dict[str, torch.Tensor]:
        from disagg_vision_sp.families.qwen_video import video_inputs

        cfg = self.vision_config()
        return video_inputs(
            videos,
            image_processor(str(self.path)),
            patch=int(cfg.patch_size),
            merge=int(cfg.spatial_merge_size),
            temporal=int(cfg.temporal_patch_size),
            **limits,
        )

    @staticmethod
    def grid(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[items, 3]`` grids of a sample's images, then its videos (the rows' order)."""
        parts = [inputs[k].reshape(-1, 3) for k in ("image_grid_thw", "video_grid_thw") if k in inputs]
        return torch.cat(parts).to(torch.long)

    @staticmethod
    def pixels(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """A sample's patches: its images', then its videos' (the same patch vector width)."""
        parts = [inputs[k] for k in ("pixel_values", "pixel_values_videos") if k in inputs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def num_tokens(self, inputs: dict[str, torch.Tensor]) -> list[int]:
        merge = int(self.vision_config().spatial_merge_size)
        return [int(t * h * w) // merge**2 for t, h, w in self.grid(inputs).tolist()]

    def encode(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels = self.pixels(inputs).to(module.device, module.dtype)
        return module(pixels, grid_thw=self.grid(inputs).to(module.device)).pooler_output

    # -- ulysses hook points --------------------------------------------------------------------
    def ulysses_heads(self) -> int:
        return int(self.vision_config().num_heads)

    def ulysses_layout(self, inputs: list[dict[str, torch.Tensor]]) -> SeqLayout:
        from transformers.vision_utils import (
            get_vision_cu_seqlens,
            get_vision_position_ids,
            get_vision_window_index,
        )

        cfg = self.vision_config()
        merge = int(cfg.spatial_merge_size)
        unit = merge * merge
        grid = torch.cat([self.grid(x) for x in inputs])
        # The same helpers HF's forward uses, over the whole microbatch at once.
        window_index, cu_window = get_vision_window_index(
            grid, spatial_merge_size=merge, window_size=cfg.window_size, patch_size=cfg.patch_size
        )
        full_cu = get_vision_cu_seqlens(grid)
        sample_rows = [sum(self.num_tokens(x)) for x in inputs]
        starts = torch.tensor([0] + sample_rows).cumsum(0)
        row_sample = torch.searchsorted(starts, window_index, right=True) - 1
        return SeqLayout(
            n_tokens=int(full_cu[-1]),
            cuts=[int(c) for c in cu_window.tolist()],
            unit=unit,
            row_sample=row_sample,
            row_pos=window_index - starts[row_sample],
            sample_rows=sample_rows,
            extra={
                "window_index": window_index,
                "cu_window": cu_window.to(torch.long),
                "full_segments": (full_cu[1:] - full_cu[:-1]).tolist(),
                "position_ids": get_vision_position_ids(grid, merge),
            },
        )

    def embed(
        self, module: nn.Module, inputs: list[dict[str, torch.Tensor]], layout: SeqLayout, lo: int, hi: int
    ) -> tuple[torch.Tensor, Any]:
        """Patch and rotary embeddings of compute-order tokens ``[lo, hi)`` (window order)."""
        unit, dev = layout.unit, module.device
        units = layout.extra["window_index"][lo // unit : hi // unit]
        # original (processor-order) token index of every local token, in window order
        tokens = (units[:, None] * unit + torch.arange(unit)).reshape(-1)
        pixels = torch.cat([self.pixels(x) for x in inputs])[tokens].to(dev, module.dtype)
        hidden = module.patch_embed(pixels)
        return hidden, module.rotary_pos_emb(hidden, layout.extra["position_ids"][tokens].to(dev))

    def full_blocks(self, module: nn.Module) -> set[int]:
        """Blocks that attend over whole images (they span shards); the others attend per window."""
        return set(module.fullatt_block_indexes)

    def local_windows(
        self, layout: SeqLayout, lo: int, hi: int, dev: torch.device
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """``cu_seqlens`` and varlen keywords of the attention windows inside ``[lo, hi)``."""
        cu_window = layout.extra["cu_window"]
        local_windows = cu_window[(cu_window >= lo) & (cu_window <= hi)] - lo
        if local_windows.numel() < 2:  # an empty shard still runs every block (collectives)
            local_windows = torch.zeros(2, dtype=torch.long)
        # window lengths from host memory: the attention's varlen call needs no device sync
        bounds = [int(x) for x in local_windows.tolist()]
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        return local_windows.to(dev, torch.int32), {"max_seqlen": max(lengths), LENGTHS_KWARG: lengths}

    def tapped_blocks(self, module: nn.Module) -> tuple[int, ...]:
        """Blocks whose output :meth:`merge` reads besides the last one's."""
        return ()

    def merge(self, module: nn.Module, hidden: torch.Tensor, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        """Output rows of the last block's ``hidden`` (and the tapped blocks' outputs)."""
        return module.merger(hidden)

    def ulysses_forward(
        self,
        module: nn.Module,
        inputs: list[dict[str, torch.Tensor]],
        layout: SeqLayout,
        lo: int,
        hi: int,
        scope: AttentionScope,
    ) -> torch.Tensor:
        # Shared by the Qwen towers: qwen2_vl and qwen3_vl have no windows (every block is full)
        # and qwen3_vl taps blocks for its DeepStack mergers.
        hidden, rotary = self.embed(module, inputs, layout, lo, hi)
        dev = module.device
        full = self.full_blocks(module)
        windows = self.local_windows(layout, lo, hi, dev) if len(full) < len(module.blocks) else None
        whole = torch.tensor([0, hi - lo], device=dev, dtype=torch.int32)
        # the local span's length from host memory: the varlen call needs no device sync
        spanning = {"max_seqlen": hi - lo, LENGTHS_KWARG: [hi - lo]}
        tapped = set(self.tapped_blocks(module))
        taps: dict[int, torch.Tensor] = {}
        for i, block in enumerate(module.blocks):
            if i in full:
                with scope.spanning(layout.extra["full_segments"]):
                    hidden = block(hidden, cu_seqlens=whole, position_embeddings=rotary, **spanning)
            else:
                assert windows is not None
                local, kw = windows
                hidden = block(hidden, cu_seqlens=local, position_embeddings=rotary, **kw)
            if i in tapped:
                taps[i] = hidden
        return self.merge(module, hidden, taps)
