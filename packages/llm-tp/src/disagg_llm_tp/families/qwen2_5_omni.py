"""``qwen2_5_omni`` (role llm): the thinker's language model and ``lm_head`` inside a
Qwen2.5-Omni dir (whole, ``thinker.*`` tensors, or a thinker dir).

``build`` loads ``Qwen2_5OmniThinkerForConditionalGeneration`` (from a whole
dir it reads the thinker's tensors and never the talker's) and drops both
towers, owned by the vision (``qwen2_5_omni``) and audio (``qwen2_5_omni_audio``)
groups. ``run`` is the thinker's forward once the rows are in ``inputs_embeds``:
its mRoPE positions (``compute_3d_position_ids``: 3D for images and videos, a video's time
axis at ``video_second_per_grid * position_id_per_seconds`` per temporal patch, consecutive
for text and audio, which need each clip's mel-frame count), the text model, ``lm_head``.
A sample's vision rows are its images' then its videos' (placed at ``<|IMAGE|>`` then
``<|VIDEO|>``, as Qwen2.5-VL's); ``use_audio_in_video`` is refused by name.
Export maps every name back to the dir's own keys, so the three modules' export
is one dir that the HF thinker class loads.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import nn

from disagg_llm_tp.families.qwen2_5_vl import Qwen25VLLanguageFamily

#: marker tokens around each item, as Qwen2.5-Omni's processor writes them
_WRAP = {"vision": ("<|vision_bos|>", "<|vision_eos|>"), "audio": ("<|audio_bos|>", "<|audio_eos|>")}


class Qwen25OmniLanguageFamily(Qwen25VLLanguageFamily):
    #: its forward is not split yet (its own positions/run are untested under context parallelism)
    context_parallel_support: ClassVar[bool] = False

    name: ClassVar[str] = "qwen2_5_omni"
    # transformers before 5.24 lay the thinker out otherwise (5.18: no Qwen2_5OmniThinkerModel;
    # 5.21-5.23: the LLM's forward fails on a microbatch): tests/test_e2e_qwen2_5_omni.py passes
    # from 5.24 (docs/gpu.md#releases-tested)
    requires_transformers: ClassVar[tuple[str, str] | None] = (
        "5.24",
        "its Qwen2.5-Omni thinker classes changed layout and inputs up to 5.24",
    )
    vlm_model_types: ClassVar[tuple[str, ...]] = ("qwen2_5_omni_thinker",)
    placeholder_tokens: ClassVar[dict[str, str]] = {"vision": "<|IMAGE|>", "audio": "<|AUDIO|>"}

    @classmethod
    def hf_classes(cls) -> tuple[type, type]:
        from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

        return Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    @classmethod
    def planning_shape(cls, config, options=None, llm_hidden=None):  # type: ignore[no-untyped-def]
        from disagg_llm_tp.families.shapes import hf_decoder_shape

        thinker = config.get("thinker_config") or config
        # the thinker keeps its lm_head apart (its text config's tie default does not apply)
        tie = bool(thinker.get("tie_word_embeddings", False))
        return dataclasses.replace(hf_decoder_shape(thinker), tie_embeddings=tie)

    @property
    def config(self) -> Any:
        cfg = self.hf_config()
        return getattr(cfg, "thinker_config", cfg)  # a whole Omni dir nests the thinker

    @cached_property
    def _whole(self) -> bool:
        """A whole Omni dir: the thinker's tensors are stored under ``thinker.``."""
        return any(k.startswith("thinker.") for k in self._stored_keys)

    def prune(self, model: nn.Module) -> nn.Module:
        model.model.visual = None  # owned by the vision group
        model.model.audio_tower = None  # owned by the audio group
        return model

    def placeholder_text(self, module: str, n_tokens: int) -> str:
        bos, eos = _WRAP[module]
        return bos + self.placeholder_tokens[module] * n_tokens + eos

    def check(self, strategy: str, degree: int, replicas: int) -> list[str]:
        problems = super().check(strategy, degree, replicas)
        if self.options.get("use_audio_in_video"):
            problems.append(
                "model.llm.options.use_audio_in_video: true is not supported: a video's own audio "
                "track is not read (its frames go to the vision module alone, as "
                "Qwen2_5OmniProcessor does with load_audio_from_video off); give the audio as its "
                "own <audio> item instead, or set it to false"
            )
        return problems

    def video_placeholder_text(self, n_tokens: int, timestamps: list[float] | None = None) -> str:
        bos, eos = _WRAP["vision"]
        return bos + "<|VIDEO|>" * n_tokens + eos

    def extra_inputs(self, encoder_inputs: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        vision = encoder_inputs.get("vision") or {}
        out = super().extra_inputs(encoder_inputs)
        # the thinker's own name for the seconds per temporal patch (Qwen2.5-VL's is not made)
        if "video_second_per_grid" in vision:
            out["video_second_per_grid"] = vision["video_second_per_grid"]
        audio = encoder_inputs.get("audio") or {}
        if "feature_attention_mask" in audio:
            # each clip's mel frames: the thinker's positions count its audio rows from them
            out["audio_feature_lengths"] = audio["feature_attention_mask"].sum(-1)
        return out

    def run(self, module, ids, embeds, mask, inputs, rows):
        grids = [x["image_grid_thw"].reshape(-1, 3) for x in inputs if "image_grid_thw" in x]
        lens = [x["audio_feature_lengths"].reshape(-1) for x in inputs if "audio_feature_lengths" in x]
        # videos in sample order, as get_rope_index counts them over the batch
        videos = [x for x in inputs if "video_grid_thw" in x]
        model = module.model
        model.rope_deltas = None  # never reuse positions cached by an earlier call
        positions = model.compute_3d_position_ids(
            input_ids=ids,
            image_grid_thw=torch.cat(grids).to(ids.device) if grids else None,
            video_grid_thw=torch.cat([x["video_grid_thw"].reshape(-1, 3) for x in videos]).to(ids.device)
            if videos
            else None,
            inputs_embeds=embeds,
            attention_mask=mask,
            cache=None,
            audio_feature_lengths=torch.cat(lens).to(ids.device) if lens else None,
            video_second_per_grid=torch.cat([x["video_second_per_grid"].reshape(-1) for x in videos])
            if videos
            else None,
        )
        hidden = model.language_model(
            inputs_embeds=embeds, position_ids=positions, attention_mask=mask, use_cache=False
        ).last_hidden_state
        return module.lm_head(hidden)

    def _tied(self) -> bool:
        # the thinker's text config defaults tie_word_embeddings to true even where the
        # thinker (and its checkpoint) keeps a separate lm_head
        return not any(k.endswith("lm_head.weight") for k in self._stored_keys)

    def _checkpoint_name(self, name: str, keys: set[str]) -> str:
        # build()'s names (transformers 5) -> the stored ones: model.language_model.* is
        # model.* in the published layout, all under thinker. in a whole dir
        stored = (
            "model." + name[len("model.language_model.") :]
            if name.startswith("model.language_model.")
            else name
        )
        prefix = "thinker." if self._whole else ""
        return prefix + stored if prefix + stored in keys else name

    @classmethod
    def make_tiny(cls, out_dir, tokenizer_dir=None, **kwargs):  # type: ignore[no-untyped-def]
        raise NotImplementedError(
            "the vision family qwen2_5_omni builds the dir (make-tiny --families qwen2_5_omni)"
        )
