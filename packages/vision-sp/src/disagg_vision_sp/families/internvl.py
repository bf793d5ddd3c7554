"""``internvl`` vision family: an InternVL dir's InternViT tower + pixel shuffle + MLP
``multi_modal_projector`` (transformers' ``InternVLForConditionalGeneration``).

``encode`` is ``InternVLModel.get_image_features`` for one sample. The image processor
(GOT-OCR2's, PIL backend) cuts each image into equal square tiles (plus a thumbnail);
every tile is one full-attention segment of ``1 + g²`` tokens (a CLS token, then ``g x g``
patches in row-major order). The CLS row never reaches the LLM, and the pixel shuffle
turns each band of ``f`` patch rows (``f = 1 / downsample_ratio``) into ``g / f`` rows of
``f² x hidden`` features, which the projector maps to the LLM's width.

Under ``ulysses`` a shard may start or end at a tile's start or at a band boundary,
so every shard holds whole bands and shuffles them itself. A band's ``g / f`` output
rows are written at the band's first ``g / f`` token positions; the band's other
positions and the CLS position are rows the family computes (zeros) but the LLM never
receives (``row_sample`` -1). That keeps one row per token (``unit`` 1: a tile's
``1 + g²`` tokens are not a multiple of ``f²``) at the cost of a zero-filled output
buffer ``f²`` times the rows sent.

Video: every sampled frame is one more tile (``InternVLVideoProcessor``: resized to the tile
size, no cropping; frames sampled as its ``sample_frames``), after the sample's image tiles;
the LLM family writes ``Frame{i}: <img>...</img>`` per frame at the same image tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from disagg.interfaces import AttentionScope, LayerMap, SeqLayout
from disagg.kit.hf import check_attn_implementation
from disagg_vision_sp.families.common import (
    TowerProjectorFamily,
    check_model_type,
    image_processor,
    load_image,
)


def _encoder_class() -> type:
    """The module ``build`` returns: InternVL minus its language model, loadable with
    ``from_pretrained`` from a whole InternVL dir (the decoder's tensors are skipped)."""
    from transformers import AutoModel
    from transformers.models.internvl.modeling_internvl import (
        InternVLMultiModalProjector,
        InternVLPreTrainedModel,
    )

    class InternVLVisionEncoder(InternVLPreTrainedModel):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.vision_tower = AutoModel.from_config(config.vision_config)
            self.multi_modal_projector = InternVLMultiModalProjector(config)
            self.post_init()

    return InternVLVisionEncoder


def pixel_shuffle(features: torch.Tensor, ratio: float) -> torch.Tensor:
    """``InternVLModel.pixel_shuffle`` (it reads nothing from the model): ``[B, rows, cols, C]``
    -> ``[B, rows·r, cols·r, C / r²]``. Called on whole bands of ``1 / r`` rows it equals the
    shuffle of the whole grid restricted to them (each output row reads one band only)."""
    from transformers.models.internvl.modeling_internvl import InternVLModel

    return InternVLModel.pixel_shuffle(None, features, scale_factor=ratio)  # type: ignore[arg-type]


class InternVLVision(TowerProjectorFamily):
    """Options: ``attn_implementation`` (sdpa | eager | flash_attention_2)."""

    name: ClassVar[str] = "internvl"
    encoder_class = staticmethod(_encoder_class)
    #: video frames are tiles (``InternVLProcessor``: ``Frame{i}: <img>...</img>`` per frame)
    reads_video: ClassVar[bool] = True
    video_sampling: ClassVar[str] = "internvl"

    @classmethod
    def planning_shape(cls, config, options=None, llm_hidden=None):  # type: ignore[no-untyped-def]
        from disagg_vision_sp.families.shapes_internvl import internvl_shape

        return internvl_shape(config)

    # -- config (read once: TowerProjectorFamily) -----------------------------------------------
    def _factor(self) -> int:
        """Patch rows (and columns) one shuffled row merges: ``1 / downsample_ratio``."""
        return round(1 / float(self.config().downsample_ratio))

    def _grid(self) -> int:
        """Patches along a tile's side."""
        v = self.config().vision_config
        return int(v.image_size[0]) // int(v.patch_size[0])

    def check(self, strategy: str, degree: int, replicas: int) -> list[str]:
        problems = check_model_type(self.path, "internvl", ("internvl",))
        if problems:
            return problems
        problems = check_attn_implementation(self.options, "vision")
        cfg = self.config()
        where = f"in {self.path}/config.json"
        if cfg.vision_feature_layer != -1:
            problems.append(
                f"vision_feature_layer={cfg.vision_feature_layer!r} {where}: family 'internvl' "
                "reads the tower's last layer only (allowed: -1)"
            )
        if cfg.vision_feature_select_strategy != "default":
            # 'full' keeps the CLS row: 1 + g² rows are no square grid, and HF's shuffle fails too
            problems.append(
                f"vision_feature_select_strategy={cfg.vision_feature_select_strategy!r} {where}: "
                "family 'internvl' supports 'default' (the CLS row dropped)"
            )
        v = cfg.vision_config
        f = self._factor()
        if abs(f * float(cfg.downsample_ratio) - 1) > 1e-9 or self._grid() % f:
            problems.append(
                f"downsample_ratio={cfg.downsample_ratio} {where}: family 'internvl' needs 1/ratio to be "
                f"an integer that divides the {self._grid()} patches of a tile's side"
            )
        if tuple(v.image_size) != (v.image_size[0],) * 2 or tuple(v.patch_size) != (v.patch_size[0],) * 2:
            problems.append(
                f"vision_config image_size/patch_size {where}: family 'internvl' needs square tiles"
            )
        return problems

    # -- building (build, build_empty, checkpoint_name, parts: TowerProjectorFamily) ------------
    def layer_map(self) -> LayerMap:
        layers = "vision_tower.encoder.layer.*"
        attn = f"{layers}.attention"
        no_split = {}
        if self.config().vision_config.use_qk_norm:
            no_split[f"{attn}.q_norm"] = (
                "InternViT's q/k RMSNorms (use_qk_norm) normalise over every head's width at once, "
                "which a rank holding some heads cannot compute"
            )
        return LayerMap(
            column=(
                f"{attn}.q_proj",
                f"{attn}.k_proj",
                f"{attn}.v_proj",
                f"{layers}.mlp.fc1",
                "multi_modal_projector.linear_1",
            ),
            row=(f"{attn}.projection_layer", f"{layers}.mlp.fc2", "multi_modal_projector.linear_2"),
            # the attention reshapes its output to embed_dim: a rank's heads are embed_dim / degree wide
            heads={attn: ("num_heads", "embed_dim")},
            # Full copies on every TP rank: embeddings, norms, layer-scale vectors, the
            # projector's LayerNorm (over whole shuffled rows, before linear_1 splits them).
            replicated=(
                "vision_tower.embeddings.*",
                f"{layers}.layernorm_before.*",
                f"{layers}.layernorm_after.*",
                f"{layers}.lambda_*",
                f"{attn}.q_norm.*",
                f"{attn}.k_norm.*",
                "vision_tower.layernorm.*",
                "multi_modal_projector.layer_norm.*",
            ),
            no_split=no_split,
        )

    @classmethod
    def make_tiny(cls, out_dir: Path, tokenizer_dir: Path | None = None) -> Path:
        from disagg_vision_sp.families.tiny_internvl import make_tiny_internvl

        return make_tiny_internvl(Path(out_dir))

    # -- data -----------------------------------------------------------------------------------
    def preprocess(self, media: list[Any]) -> dict[str, torch.Tensor]:
        """Tiles of every image (``crop_to_patches``, as InternVL's processor asks) and how many
        tiles each image became."""
        proc = image_processor(str(self.path))
        out = proc(images=[load_image(m) for m in media], crop_to_patches=True, return_tensors="pt")
        tiles = torch.as_tensor(out["num_patches"], dtype=torch.long).reshape(-1)
        return {"pixel_values": out["pixel_values"].to(torch.float32), "num_patches": tiles}

    def preprocess_video(self, videos: list[Any], **limits: int) -> dict[str, torch.Tensor]:
        """Every sampled frame as one tile, as ``InternVLVideoProcessor`` makes it: resized to the
        tile size (bicubic; PIL here, torchvision there, so pixels may differ by resampling
        rounding), rescaled and normalized with the image processor's mean and std; no cropping
        into several tiles, no thumbnail."""
        if limits:
            raise ValueError(
                f"{', '.join('data.video_' + k for k in sorted(limits))}: family 'internvl' resizes "
                "every frame to one tile; remove them (bound a video with data.video_max_frames)"
            )
        from PIL import Image

        proc = image_processor(str(self.path))
        side = int(self.config().vision_config.image_size[0])  # the tower's tile
        frames = [
            np.asarray(Image.fromarray(f).resize((side, side), Image.Resampling.BICUBIC))
            for v in videos
            for f in v.frames
        ]
        x = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).to(torch.float32) * float(
            proc.rescale_factor
        )
        mean = torch.tensor(proc.image_mean, dtype=torch.float32)[None, :, None, None]
        std = torch.tensor(proc.image_std, dtype=torch.float32)[None, :, None, None]
        counts = torch.tensor([len(v.frames) for v in videos], dtype=torch.long)
        return {"pixel_values_videos": (x - mean) / std, "video_frames": counts}

    def _tile_rows(self) -> int:
        """LLM rows of one tile (``image_seq_length`` in a published dir)."""
        return (self._grid() // self._factor()) ** 2

    def num_tokens(self, inputs: dict[str, torch.Tensor]) -> list[int]:
        # a sample's images (tiles each), then its videos (frames each): the rows' order
        items = [inputs[k].reshape(-1) for k in ("num_patches", "video_frames") if k in inputs]
        return [int(n) * self._tile_rows() for n in torch.cat(items)]

    @staticmethod
    def tiles(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """A sample's tiles: its images', then its videos' frames (one tile each)."""
        parts = [inputs[k] for k in ("pixel_values", "pixel_values_videos") if k in inputs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _project(self, module: nn.Module, bands: torch.Tensor) -> torch.Tensor:
        """Patch tokens ``[n_bands, f·g, C]`` (whole bands) -> LLM rows ``[n_bands·g/f, out]``."""
        f, g = self._factor(), self._grid()
        shuffled = pixel_shuffle(bands.reshape(-1, f, g, bands.shape[-1]), 1 / f)
        return module.multi_modal_projector(shuffled.reshape(-1, shuffled.shape[-1]))

    def encode(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels = self.tiles(inputs).to(module.device, module.dtype)
        features = module.vision_tower(pixel_values=pixels, return_dict=True).last_hidden_state[:, 1:]
        f, g = self._factor(), self._grid()
        return self._project(module, features.reshape(-1, f * g, features.shape[-1]))

    # -- ulysses hook points --------------------------------------------------------------------
    def ulysses_heads(self) -> int:
        return int(self.config().vision_config.num_attention_heads)

    def ulysses_layout(self, inputs: list[dict[str, torch.Tensor]]) -> SeqLayout:
        f, g = self._factor(), self._grid()
        per_tile, band, out_per_band = 1 + g * g, f * g, g // f
        tiles = [int(self.tiles(x).shape[0]) for x in inputs]
        n = sum(tiles) * per_tile
        # within a tile: the CLS token, then g/f bands; a band's first g/f positions carry its rows
        in_tile = torch.arange(n) % per_tile
        in_band = (in_tile - 1) % band
        kept = (in_tile > 0) & (in_band < out_per_band)
        tile_sample = torch.repeat_interleave(
            torch.arange(len(inputs)), torch.tensor(tiles, dtype=torch.long)
        )
        row_sample = torch.where(kept, tile_sample.repeat_interleave(per_tile), -1)
        row_pos = torch.zeros(n, dtype=torch.long)
        for s in range(len(inputs)):
            mine = row_sample == s
            row_pos[mine] = torch.arange(int(mine.sum()))
        starts = [t * per_tile for t in range(sum(tiles))]
        cuts = sorted({*starts, n, *(s + 1 + k * band for s in starts for k in range(g // f))})
        return SeqLayout(
            n_tokens=n,
            cuts=cuts,
            unit=1,
            row_sample=row_sample,
            row_pos=row_pos,
            sample_rows=[sum(self.num_tokens(x)) for x in inputs],
            extra={"segments": [per_tile] * sum(tiles), "per_tile": per_tile},
        )

    def ulysses_forward(
        self,
        module: nn.Module,
        inputs: list[dict[str, torch.Tensor]],
        layout: SeqLayout,
        lo: int,
        hi: int,
        scope: AttentionScope,
    ) -> torch.Tensor:
        p = layout.extra["per_tile"]
        first, last = lo // p, -(-hi // p)  # tiles overlapping [lo, hi)
        pixels = torch.cat([self.tiles(x) for x in inputs])[first:last].to(module.device, module.dtype)
        tower = module.vision_tower
        # CLS + patch + position embeddings are per token: embed the overlapping tiles, keep ours
        hidden = tower.embeddings(pixels)
        hidden = hidden.reshape(-1, hidden.shape[-1])[lo - first * p : hi - first * p].unsqueeze(0)
        with scope.spanning(layout.extra["segments"]):
            for layer in tower.encoder.layer:
                hidden = layer(hidden)
        hidden = tower.layernorm(hidden)[0]  # per token (an Identity under mean pooling)
        f, g = self._factor(), self._grid()
        band, out_per_band = f * g, g // f
        # the bands this shard holds whole (cuts fall on band boundaries): their first positions
        pos = torch.arange(lo, hi)
        heads = torch.nonzero(((pos % p) - 1) % band == 0).flatten()
        heads = heads[(pos[heads] % p) > 0]  # not a CLS position
        take = (heads[:, None] + torch.arange(band)).flatten()
        rows = self._project(module, hidden[take.to(hidden.device)].reshape(-1, band, hidden.shape[-1]))
        where = (heads[:, None] + torch.arange(out_per_band)).flatten().to(rows.device)
        return rows.new_zeros(hi - lo, rows.shape[-1]).index_copy(0, where, rows)
