"""``qwen2_5_vl`` (role llm): the language model and ``lm_head`` inside a whole
Qwen2.5-VL dir, with HF's own 3D mRoPE positions.

``build`` loads ``Qwen2_5_VLForConditionalGeneration`` and drops its vision
tower (the vision group owns it), so parameter names stay the checkpoint's
(``model.language_model.*``, ``lm_head.weight``) and the forward is HF's:
``Qwen2_5_VLModel`` computes the positions with ``get_rope_index`` from
``input_ids``, ``mm_token_type_ids``, ``image_grid_thw`` and, for video,
``video_grid_thw`` with ``second_per_grid_ts`` (MRoPE's time axis). The vision
module's rows of a sample are its images' then its videos'; they go to the
``<|image_pad|>`` and then the ``<|video_pad|>`` tokens, as HF places them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from disagg_llm_tp.families.base import HFDecoderFamily
from disagg_llm_tp.families.tiny import decoder_sizes, qwen_tokenizer, save_random


class Qwen25VLLanguageFamily(HFDecoderFamily):
    name: ClassVar[str] = "qwen2_5_vl"
    vlm_model_types: ClassVar[tuple[str, ...]] = ("qwen2_5_vl",)
    placeholder_tokens: ClassVar[dict[str, str]] = {"vision": "<|image_pad|>"}
    head_attrs: ClassVar[tuple[str, ...]] = ("num_heads",)
    #: places video rows (at ``video_token_id``, with MRoPE's time axis); the subclasses' HF
    #: models count video positions their own way, untested here
    takes_video: ClassVar[bool] = True

    @classmethod
    def hf_classes(cls) -> tuple[type, type]:
        """(config class, ``ForConditionalGeneration`` class) of the whole VLM."""
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    def hf_class(self) -> type:
        return self.hf_classes()[1]

    def prune(self, model: nn.Module) -> nn.Module:
        model.model.visual = None  # owned by the vision group; not trained here
        return model

    def placeholder_text(self, module: str, n_tokens: int) -> str:
        return "<|vision_start|>" + "<|image_pad|>" * n_tokens + "<|vision_end|>"

    def video_token_id(self) -> int | None:
        return int(self.config.video_token_id) if self.takes_video else None

    def video_placeholder_text(self, n_tokens: int, timestamps: list[float] | None = None) -> str:
        return "<|vision_start|>" + "<|video_pad|>" * n_tokens + "<|vision_end|>"

    def extra_inputs(self, encoder_inputs: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        vision = encoder_inputs.get("vision") or {}
        grid = vision.get("image_grid_thw", vision.get("grid_thw"))
        out = {} if grid is None else {"image_grid_thw": grid}
        if self.video_token_id() is not None:
            out.update({k: vision[k] for k in ("video_grid_thw", "second_per_grid_ts") if k in vision})
        return out

    def scatter(
        self, embeds: torch.Tensor, ids: torch.Tensor, rows: list[dict[str, torch.Tensor]]
    ) -> torch.Tensor:
        """A sample's vision rows are its images' then its videos': the first go to the image
        tokens, the rest to the video tokens (split as a module of their own)."""
        vid = self.video_token_id()
        if vid is None or not any("vision" in r for r in rows):
            return super().scatter(embeds, ids, rows)
        video_rows = "vision:video"
        split = []
        for i, r in enumerate(rows):
            r = dict(r)
            if "vision" in r:
                n_image = int((ids[i] == self._pid("vision")).sum())
                r["vision"], videos = r["vision"][:n_image], r["vision"][n_image:]
                if videos.shape[0]:
                    r[video_rows] = videos
            split.append(r)
        self._placeholder_ids[video_rows] = vid
        return super().scatter(embeds, ids, split)

    def mrope_inputs(
        self, ids: torch.Tensor, inputs: list[dict[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What HF's mRoPE positions read: each token's type (1 image, 2 video) and the
        microbatch's image grids (None when it has no image)."""
        cfg = self.config
        types = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
        grids = [x["image_grid_thw"].reshape(-1, 3) for x in inputs if "image_grid_thw" in x]
        return types, (torch.cat(grids).to(ids.device) if grids else None)

    def video_inputs(
        self, ids: torch.Tensor, inputs: list[dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """The microbatch's video grids and seconds per temporal patch (MRoPE's time axis), in
        sample order as HF's ``get_rope_index`` consumes them; empty without video."""
        grids = [x["video_grid_thw"].reshape(-1, 3) for x in inputs if "video_grid_thw" in x]
        if not grids:
            return {}
        secs = [x["second_per_grid_ts"].reshape(-1) for x in inputs if "video_grid_thw" in x]
        return {"video_grid_thw": torch.cat(grids).to(ids.device), "second_per_grid_ts": torch.cat(secs)}

    def run(self, module, ids, embeds, mask, inputs, rows):
        types, grid = self.mrope_inputs(ids, inputs)
        module.model.rope_deltas = None  # never reuse positions cached by an earlier call
        return module(
            input_ids=ids,
            inputs_embeds=embeds,
            attention_mask=mask,
            image_grid_thw=grid,
            mm_token_type_ids=types,
            use_cache=False,
            **self.video_inputs(ids, inputs),
        ).logits

    def position_ids(self, module, ids, mask, inputs):
        """HF's 3-D mRoPE positions ``(3, batch, tokens)`` of the whole padded batch, from the
        model's own ``get_rope_index`` (what its forward computes from ``input_ids``); a
        microbatch without images gets the text positions HF would infer."""
        types, grid = self.mrope_inputs(ids, inputs)
        video = self.video_inputs(ids, inputs)
        if grid is None and not video:
            return super().position_ids(module, ids, mask, inputs)[None].expand(3, -1, -1)
        positions, _ = module.model.get_rope_index(
            ids, mm_token_type_ids=types, image_grid_thw=grid, attention_mask=mask, **video
        )
        return positions

    @classmethod
    def make_tiny(
        cls,
        out_dir: Path,
        tokenizer_dir: Path | None = None,
        *,
        vocab_size: int | None = None,
        tie_word_embeddings: bool = False,
        seed: int = 0,
    ) -> Path:
        """A whole tiny Qwen2.5-VL dir (vision tower included, random weights),
        its tokenizer with the Qwen special tokens, and ``preprocessor_config.json``."""
        config_cls, model_cls = cls.hf_classes()
        out = Path(out_dir)
        tok = qwen_tokenizer(out)
        ids = {
            t: tok.convert_tokens_to_ids(t)
            for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
        }
        text = decoder_sizes(vocab_size or len(tok))
        # head_dim 16 -> 8 rotary frequencies, split over (t, h, w) as HF's 16/24/24 is for 128.
        text.update(
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            bos_token_id=None,
        )
        text.update(cls.tiny_text())
        config = config_cls(
            text_config=text,
            vision_config=cls.tiny_vision(text["hidden_size"]),
            tie_word_embeddings=tie_word_embeddings,
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
        save_random(model_cls, config, out, seed)
        _write_preprocessor(out)
        return out

    @classmethod
    def tiny_text(cls) -> dict:
        """Text-config entries a subclass's tiny dir changes."""
        return {}

    @classmethod
    def tiny_vision(cls, out_hidden: int) -> dict:
        """The tiny dir's vision config (patch 14, merge 2; the vision group's business)."""
        return dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            out_hidden_size=out_hidden,
            fullatt_block_indexes=[1],
        )


def _write_preprocessor(out: Path) -> None:
    """Qwen2-VL image processor settings for tiny images (patch 14, merge 2)."""
    cfg = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": 28 * 28 * 4,
        "max_pixels": 28 * 28 * 16,
        "size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 16},
    }
    (out / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2))
