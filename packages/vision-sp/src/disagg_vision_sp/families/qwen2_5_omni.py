"""``qwen2_5_omni`` vision family: the thinker's ``visual`` tower of a Qwen2.5-Omni dir.

A whole Qwen2.5-Omni dir (``model_type: qwen2_5_omni``, the thinker's tensors under
``thinker.*``; talker and token2wav, if present, are never read) or a thinker dir
(``qwen2_5_omni_thinker``) serves three modules at once: this tower, the audio
tower (``qwen2_5_omni_audio``, disagg-audio) and the language model
(``qwen2_5_omni``, disagg-llm-tp). The tower is Qwen2.5-VL's (window attention
except ``fullatt_block_indexes``, RMSNorm SwiGLU blocks, the 2x2 merger) with
separate ``q``/``k``/``v`` linears, so the Qwen2.5-VL hook points run it as they are.

Video is Qwen2.5-VL's (transformers' ``Qwen2_5OmniProcessor`` uses the same
``Qwen2VLVideoProcessor``: frame sampling, ``smart_resize``, temporal patches), except MRoPE's
time axis: the processor hands over ``video_second_per_grid = temporal_patch_size / fps`` with
``fps`` the rate asked for (``data.video_fps``), not the sampled rate Qwen2.5-VL's uses. The
video's own audio track (``use_audio_in_video``) is not read: see :meth:`check`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from disagg.interfaces import LayerMap
from disagg.kit.hf import checkpoint_keys, find_prefix, quiet_transformers
from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision


def audio_in_video_problems(module: str, options: dict[str, Any]) -> list[str]:
    """``use_audio_in_video`` (the video's own audio track interleaved with its frames, 2 s
    chunks) is refused: it needs the audio track decoded into the audio module's inputs and
    the chunked prompt and positions, none of which the data pipeline makes yet."""
    if not options.get("use_audio_in_video"):
        return []
    return [
        f"model.{module}.options.use_audio_in_video: true is not supported: a video's own audio "
        "track is not read (each video's frames go to the vision module alone, as "
        "Qwen2_5OmniProcessor does with load_audio_from_video off); give the audio as its own "
        "<audio> item instead, or set it to false"
    ]


class Qwen2_5OmniVision(Qwen2_5_VLVision):
    """Options: ``attn_implementation`` (sdpa | eager | flash_attention_2)."""

    reads_video: ClassVar[bool] = True

    name: ClassVar[str] = "qwen2_5_omni"
    # transformers before 5.24 lay the thinker out otherwise (5.18: no Qwen2_5OmniThinkerModel;
    # 5.21-5.23: the LLM's forward fails on a microbatch): tests/test_e2e_qwen2_5_omni.py passes
    # from 5.24 (docs/gpu.md#releases-tested)
    requires_transformers: ClassVar[tuple[str, str] | None] = (
        "5.24",
        "its Qwen2.5-Omni thinker classes changed layout and inputs up to 5.24",
    )
    model_types: ClassVar[tuple[str, ...]] = ("qwen2_5_omni", "qwen2_5_omni_thinker")
    #: where the tower lives in the dir's files: whole Omni, thinker, transformers-5 thinker
    prefixes: ClassVar[tuple[str, ...]] = ("thinker.visual.", "visual.", "model.visual.", "")

    @classmethod
    def planning_shape(cls, config, options=None, llm_hidden=None):  # type: ignore[no-untyped-def]
        from disagg_vision_sp.families.shapes import qwen2_5_omni_vision_shape

        return qwen2_5_omni_vision_shape(config)

    def vision_config(self) -> Any:
        cfg = self.hf_config()
        cfg = getattr(cfg, "thinker_config", cfg)  # a whole Omni dir nests the thinker
        return getattr(cfg, "vision_config", cfg)

    def check(self, strategy: str, degree: int, replicas: int) -> list[str]:
        return [*super().check(strategy, degree, replicas), *audio_in_video_problems("vision", self.options)]

    def preprocess_video(self, videos: list[Any], **limits: int) -> dict[str, torch.Tensor]:
        out = super().preprocess_video(videos, **limits)
        del out["second_per_grid_ts"]  # Qwen2.5-VL's, from the sampled rate
        temporal = int(self.vision_config().temporal_patch_size)
        # Qwen2_5OmniProcessor._process_videos: temporal_patch_size / the fps it was asked for
        out["video_second_per_grid"] = torch.tensor(
            [temporal / v.requested_fps for v in videos], dtype=torch.float32
        )
        return out

    def tower_class(self) -> type:
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniVisionEncoder

        return Qwen2_5OmniVisionEncoder

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        # Load only the tower's tensors: key_mapping strips the dir's prefix.
        with quiet_transformers():
            return self.tower_class().from_pretrained(
                self.path,
                config=self.vision_config(),
                key_mapping={r"^thinker\.visual\.": "", r"^model\.visual\.": "", r"^visual\.": ""},
                dtype=dtype,
                attn_implementation=self.options.get("attn_implementation", "sdpa"),
            )

    def checkpoint_name(self, name: str) -> str:
        # the inverse of build()'s key_mapping
        if getattr(self, "_prefix", None) is None:
            keys = checkpoint_keys(self.path)
            self._prefix = find_prefix(keys, "patch_embed.proj.weight", self.prefixes)
        return self._prefix + name

    def layer_map(self) -> LayerMap:
        base = super().layer_map()
        qkv = "blocks.*.attn.qkv"
        return dataclasses.replace(
            base,
            column=tuple(c for c in base.column if c != qkv)
            + tuple(f"blocks.*.attn.{p}" for p in ("q", "k", "v")),
            column_chunks={},
        )

    @classmethod
    def make_tiny(cls, out_dir: Path, tokenizer_dir: Path | None = None) -> Path:
        from disagg_vision_sp.families.tiny_qwen2_5_omni import make_tiny_qwen2_5_omni

        return make_tiny_qwen2_5_omni(Path(out_dir))
