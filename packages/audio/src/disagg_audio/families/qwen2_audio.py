"""``qwen2_audio`` audio family: the audio tower and projector of a Qwen2-Audio dir.

HF pads every clip to a 30 s window and masks the padded positions as keys;
the rows it keeps are those of the unpadded positions. Valid positions depend
only on valid keys, so running the tower on just those positions (the
convolutions still reading the padded frame they see in HF) gives the same
rows without the padding's cost. Preprocessing rounds each window's positions
up to an even count (at most 20 ms more of the silence HF pads with), so that
average pooling by 2 never leaves a lone position; the features and the
``feature_attention_mask`` HF would get for that clip give the same rows
(``packages/audio/tests/test_families.py`` checks it against HF's ``Qwen2AudioForConditionalGeneration``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from disagg.interfaces import LayerMap
from disagg.kit.hf import checkpoint_keys, empty_from_config, find_prefix, quiet_transformers
from disagg_audio.families.encoder import WhisperStyleEncoder

_PREFIXES = ("", "model.")


def _encoder_class() -> type:
    """Qwen2-Audio minus its language model, loadable with ``from_pretrained``
    from a whole Qwen2-Audio dir (the LLM's tensors are skipped)."""
    from transformers import AutoModel
    from transformers.models.qwen2_audio.modeling_qwen2_audio import (
        Qwen2AudioMultiModalProjector,
        Qwen2AudioPreTrainedModel,
    )

    class Qwen2AudioEncoderWithProjector(Qwen2AudioPreTrainedModel):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.audio_tower = AutoModel.from_config(config.audio_config)
            self.multi_modal_projector = Qwen2AudioMultiModalProjector(config)
            self.post_init()

    return Qwen2AudioEncoderWithProjector


class Qwen2AudioFamily(WhisperStyleEncoder):
    """Options: ``attn_implementation`` (sdpa | eager | flash_attention_2), ``max_seconds``."""

    name: ClassVar[str] = "qwen2_audio"

    @classmethod
    def planning_shape(cls, config, options=None, llm_hidden=None):  # type: ignore[no-untyped-def]
        from disagg_audio.families.shapes import qwen2_audio_shape

        return qwen2_audio_shape(config)

    def config(self) -> Any:
        return self.hf_config()

    def encoder_config(self) -> Any:
        return self.config().audio_config

    def unit(self) -> int:
        return 2  # the tower's AvgPool1d(2, stride=2)

    def hidden_size(self) -> int:
        return int(self.config().text_config.hidden_size)

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        with quiet_transformers():
            return _encoder_class().from_pretrained(
                self.path,
                key_mapping={
                    r"^model\.audio_tower\.": "audio_tower.",
                    r"^model\.multi_modal_projector\.": "multi_modal_projector.",
                },
                dtype=dtype,
                attn_implementation=self.options.get("attn_implementation", "sdpa"),
            )

    def build_empty(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """``build()``'s tower and projector on the meta device: ``megatron_tp`` reads only
        its own slices."""
        attn = self.options.get("attn_implementation", "sdpa")
        return empty_from_config(_encoder_class(), self.config(), dtype=dtype, attn_implementation=attn)

    def checkpoint_name(self, name: str) -> str:
        # the inverse of build()'s key_mapping: the dir's own prefix (transformers 5 adds "model.")
        if getattr(self, "_prefix", None) is None:
            probe = "multi_modal_projector.linear.weight"
            self._prefix = find_prefix(checkpoint_keys(self.path), probe, _PREFIXES)
        return self._prefix + name

    def tower(self, module: nn.Module) -> nn.Module:
        return module.audio_tower

    def tail(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        tower = module.audio_tower
        pooled = tower.avg_pooler(hidden.transpose(0, 1).unsqueeze(0))[0].transpose(0, 1)
        return module.multi_modal_projector(tower.layer_norm(pooled))

    def parts(self) -> dict[str, tuple[str, ...]]:
        return {"tower": ("audio_tower.*",), "projector": ("multi_modal_projector.*",)}

    def layer_map(self) -> LayerMap:
        layers = "audio_tower.layers.*"
        return LayerMap(
            column=(
                f"{layers}.self_attn.q_proj",
                f"{layers}.self_attn.k_proj",
                f"{layers}.self_attn.v_proj",
                f"{layers}.fc1",
            ),
            row=(f"{layers}.self_attn.out_proj", f"{layers}.fc2"),
            heads={f"{layers}.self_attn": ("num_heads",)},
            attention=self.attention(f"{layers}.self_attn"),
            # the layer drops fc1's activations (column-split) before fc2 (rng.py of llm-tp)
            feature_split={layers: ("fc1", "fc2")},
            # The projector is one Linear whose output every TP rank must hold whole: replicated.
            replicated=(
                "audio_tower.conv1.*",
                "audio_tower.conv2.*",
                "audio_tower.embed_positions.*",
                f"{layers}.self_attn_layer_norm.*",
                f"{layers}.final_layer_norm.*",
                "audio_tower.layer_norm.*",
                "multi_modal_projector.*",
            ),
        )

    def export_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.checkpoint_name(k): v for k, v in state.items()}

    @classmethod
    def make_tiny(cls, out_dir: Path, tokenizer_dir: Path | None = None) -> Path:
        from disagg_audio.families.tiny import make_tiny_qwen2_audio

        return make_tiny_qwen2_audio(Path(out_dir))
