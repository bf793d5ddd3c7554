"""``qwen2_5_omni_audio`` audio family: the thinker's ``audio_tower`` of a Qwen2.5-Omni dir.

The same dir serves the vision tower (``qwen2_5_omni``, disagg-vision-sp) and
the language model (``qwen2_5_omni``, disagg-llm-tp); this family's name differs
because both towers are encoders (families are registered per role and name).

Unlike Whisper and Qwen2-Audio, the Omni tower ends in its own projector
(``ln_post``, pooling by 2, ``proj`` to the LLM's width) and cuts each clip into
windows of ``2·n_window`` mel frames itself, attending within each. Data is
what Qwen2.5-Omni's processor gives the thinker: Whisper features padded to the
extractor's window with a ``feature_attention_mask`` (trailing padding frames are
dropped here: the thinker reads only the frames the mask keeps), and
``encode`` is the thinker's ``get_audio_features`` on one sample's clips.
Runs under ``ddp`` and ``zero`` (no layer map or sequence split is declared).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from disagg.interfaces import EncoderFamily
from disagg.kit.hf import (
    check_attn_implementation,
    checkpoint_keys,
    empty_from_config,
    find_prefix,
    quiet_transformers,
)
from disagg_audio.decode import load_waveform
from disagg_audio.features import feature_extractor

#: where the tower lives in the dir's files: whole Omni, thinker, transformers-5 thinker
_PREFIXES = ("thinker.audio_tower.", "audio_tower.", "model.audio_tower.")


def output_rows(frames: torch.Tensor) -> torch.Tensor:
    """Rows the tower makes of ``frames`` mel frames: the stride-2 convolution, then pooling
    by 2 (HF's ``Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths``)."""
    after_cnn = (frames - 1) // 2 + 1
    return (after_cnn - 2) // 2 + 1


class Qwen2_5OmniAudioFamily(EncoderFamily):
    """Options: ``attn_implementation`` (sdpa | eager | flash_attention_2)."""

    name: ClassVar[str] = "qwen2_5_omni_audio"
    # transformers before 5.24 lay the thinker out otherwise (5.18: no Qwen2_5OmniThinkerModel;
    # 5.21-5.23: the LLM's forward fails on a microbatch): tests/test_e2e_qwen2_5_omni.py passes
    # from 5.24 (docs/gpu.md#releases-tested)
    requires_transformers: ClassVar[tuple[str, str] | None] = (
        "5.24",
        "its Qwen2.5-Omni thinker classes changed layout and inputs up to 5.24",
    )
    modality: ClassVar[str] = "audio"
    model_types: ClassVar[tuple[str, ...]] = ("qwen2_5_omni", "qwen2_5_omni_thinker")

    @classmethod
    def planning_shape(cls, config, options=None, llm_hidden=None):  # type: ignore[no-untyped-def]
        from disagg_audio.families.shapes import qwen2_5_omni_audio_shape

        return qwen2_5_omni_audio_shape(config)

    # -- config ---------------------------------------------------------------------------------
    def encoder_config(self) -> Any:
        cfg = self.hf_config()
        return getattr(cfg, "thinker_config", cfg).audio_config

    def hidden_size(self) -> int:
        return int(self.encoder_config().output_dim)

    def check(self, strategy: str, degree: int, replicas: int) -> list[str]:
        import json

        cfg = Path(self.path) / "config.json"
        if not cfg.is_file():
            return [f"model.audio.path={str(self.path)!r} has no config.json (not a Hugging Face model dir)"]
        model_type = json.loads(cfg.read_text()).get("model_type")
        if model_type not in self.model_types:
            return [
                f"model.audio.path={str(self.path)!r} is a {model_type!r} model, which family {self.name!r} "
                f"cannot read (it reads {', '.join(self.model_types)})"
            ]
        return check_attn_implementation(self.options, "audio")

    # -- building -------------------------------------------------------------------------------
    def tower_class(self) -> type:
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

        return Qwen2_5OmniAudioEncoder

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        with quiet_transformers():
            return self.tower_class().from_pretrained(
                self.path,
                config=self.encoder_config(),
                key_mapping={
                    r"^thinker\.audio_tower\.": "",
                    r"^model\.audio_tower\.": "",
                    r"^audio_tower\.": "",
                },
                dtype=dtype,
                attn_implementation=self.options.get("attn_implementation", "sdpa"),
            )

    def build_empty(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        attn = self.options.get("attn_implementation", "sdpa")
        return empty_from_config(
            self.tower_class(), self.encoder_config(), dtype=dtype, attn_implementation=attn
        )

    def checkpoint_name(self, name: str) -> str:
        if getattr(self, "_prefix", None) is None:
            self._prefix = find_prefix(checkpoint_keys(self.path), "conv1.weight", _PREFIXES)
        return self._prefix + name

    def export_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.checkpoint_name(k): v for k, v in state.items()}

    def parts(self) -> dict[str, tuple[str, ...]]:
        return {
            "tower": ("conv1.*", "conv2.*", "layers.*", "audio_bos_eos_token.*"),
            "projector": ("ln_post.*", "proj.*"),
        }

    @classmethod
    def make_tiny(cls, out_dir: Path, tokenizer_dir: Path | None = None) -> Path:
        raise NotImplementedError(
            "the qwen2_5_omni dir holds this tower: disagg make-tiny --families qwen2_5_omni"
        )

    # -- data -----------------------------------------------------------------------------------
    def preprocess(self, media: list[Any]) -> dict[str, torch.Tensor]:
        fe = feature_extractor(str(self.path))
        rate = int(fe.sampling_rate)
        clips = [load_waveform(item, rate)[0] for item in media]
        # as Qwen2.5-Omni's processor calls it (clips longer than the window are cut)
        out = fe(
            clips, sampling_rate=rate, padding="max_length", return_attention_mask=True, return_tensors="np"
        )
        mask = out["attention_mask"].astype(np.int64)
        frames = int(mask.sum(axis=1).max())
        return {
            "input_features": torch.from_numpy(
                np.ascontiguousarray(out["input_features"][:, :, :frames])
            ).float(),
            "feature_attention_mask": torch.from_numpy(np.ascontiguousarray(mask[:, :frames])),
        }

    def num_tokens(self, inputs: dict[str, torch.Tensor]) -> list[int]:
        return [int(n) for n in output_rows(inputs["feature_attention_mask"].sum(-1)).tolist()]

    def encode(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        # Qwen2_5OmniThinkerModel.get_audio_features: the valid frames of every clip, concatenated
        w = module.conv1.weight
        mask = inputs["feature_attention_mask"].to(w.device)
        feats = inputs["input_features"].to(w.device, w.dtype)
        lens = mask.sum(-1)
        valid = feats.permute(0, 2, 1)[mask.bool()].permute(1, 0)
        after_cnn = (lens - 1) // 2 + 1
        return module(valid, feature_lens=lens, aftercnn_lens=after_cnn).last_hidden_state
