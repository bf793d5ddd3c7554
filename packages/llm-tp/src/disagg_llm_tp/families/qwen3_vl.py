"""``qwen3_vl`` (role llm): the language model and ``lm_head`` inside a whole
Qwen3-VL dir, with its DeepStack inputs.

The ``qwen3_vl`` vision family sends ``(1 + K) x hidden`` wide rows per image
token: the merged embedding, then the K DeepStack features. ``forward``
scatters the first block at the placeholders, as every family does, and hands
the rest to ``Qwen3VLTextModel`` as HF's ``Qwen3VLModel.forward`` does
(``visual_pos_masks`` = the image placeholders, ``deepstack_visual_embeds[k]``
= the k-th block of every image row, in batch order), so the decoder adds
feature k to its hidden states at the image positions after layer k.

Under ``megatron_tp`` the residual stream is whole on every TP rank, where the
features are added, and the embeddings' gradient (every column) is complete on
every rank. Sequence parallelism would cut the stream the features are added
to, so this family declares no sequence-parallel regions (refused by
``megatron_tp``'s check).

Video is placed as ``Qwen3VLProcessor.replace_video_token`` writes it: per
temporal patch ``<{t:.1f} seconds><|vision_start|>`` + its ``<|video_pad|>``
tokens + ``<|vision_end|>`` (``t`` from ``_calculate_timestamps``: the mean of
the patch's first and last frame's seconds), with no outer start/end pair.
``video_grid_thw`` goes to HF's ``get_rope_index`` whole (it splits it per
temporal patch itself, with no ``second_per_grid_ts``). The DeepStack features
of image and video tokens are added at both in token order, as HF's forward
joins them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from disagg.interfaces import LayerMap
from disagg_llm_tp.families.qwen2_5_vl import Qwen25VLLanguageFamily


class Qwen3VLLanguageFamily(Qwen25VLLanguageFamily):
    #: video at ``<|video_pad|>``, one timestamped group per temporal patch (module docstring)
    takes_video: ClassVar[bool] = True
    #: its forward is not split yet (its own positions/run are untested under context parallelism)
    context_parallel_support: ClassVar[bool] = False

    name: ClassVar[str] = "qwen3_vl"
    vlm_model_types: ClassVar[tuple[str, ...]] = ("qwen3_vl",)
    # Qwen3-VL's text attention keeps no head count (it reshapes with -1).
    head_attrs: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def hf_classes(cls) -> tuple[type, type]:
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        return Qwen3VLConfig, Qwen3VLForConditionalGeneration

    @classmethod
    def planning_shape(cls, config, options=None, llm_hidden=None):  # type: ignore[no-untyped-def]
        from disagg_llm_tp.families.shapes import qwen3_decoder_shape

        return qwen3_decoder_shape(config)

    def deepstack_layers(self) -> int:
        return len(self.config.vision_config.deepstack_visual_indexes)

    def video_placeholder_text(self, n_tokens: int, timestamps: list[float] | None = None) -> str:
        if timestamps is None:
            raise ValueError(f"family {self.name!r} writes each video's frame timestamps: it needs them")
        temporal = int(self.config.vision_config.temporal_patch_size)
        seconds = patch_timestamps(timestamps, temporal)
        if n_tokens % len(seconds):
            raise ValueError(f"{n_tokens} video tokens do not split over {len(seconds)} temporal patches")
        per = n_tokens // len(seconds)
        group = "<|vision_start|>" + "<|video_pad|>" * per + "<|vision_end|>"
        return "".join(f"<{t:.1f} seconds>" + group for t in seconds)

    def video_inputs(
        self, ids: torch.Tensor, inputs: list[dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        # whole grids (get_rope_index splits them per temporal patch); no second_per_grid_ts
        grids = [x["video_grid_thw"].reshape(-1, 3) for x in inputs if "video_grid_thw" in x]
        return {"video_grid_thw": torch.cat(grids).to(ids.device)} if grids else {}

    def layer_map(self) -> LayerMap:
        p = self.prefix
        return dataclasses.replace(
            super().layer_map(),
            sequence_parallel=None,
            # q/k norms act on each head's features: a full copy on every TP rank, used
            # on that rank's heads only (its gradient is summed over the TP ranks)
            head_replicated=(f"{p}.layers.*.self_attn.q_norm.*", f"{p}.layers.*.self_attn.k_norm.*"),
        )

    def placeholder_rows(self, rows: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        width, k = self.hidden_size(), self.deepstack_layers()
        for e in rows:
            if "vision" in e and e["vision"].shape[-1] != width * (1 + k):
                raise ValueError(
                    f"family 'qwen3_vl' takes image rows of {width} x (1 + {k} DeepStack layers) = "
                    f"{width * (1 + k)} columns (the qwen3_vl vision family's), got {e['vision'].shape[-1]}"
                )
        # the merged embedding goes to the placeholders; the DeepStack blocks to the decoder (run)
        return [{m: (v[:, :width] if m == "vision" else v) for m, v in e.items()} for e in rows]

    def run(self, module, ids, embeds, mask, inputs, rows):
        width, k = self.hidden_size(), self.deepstack_layers()
        deepstack: dict[str, Any] = {}
        if any("vision" in e for e in rows):
            image = ids == self._pid("vision")
            video = ids == self.config.video_token_id
            visual = image | video
            feats = []
            for i, e in enumerate(rows):
                if "vision" not in e:
                    continue
                # a sample's rows are its images', then its videos'; HF adds each at its own
                # tokens, in token order (its embed_joint)
                f = torch.zeros(ids.shape[1], width * k, dtype=e["vision"].dtype, device=e["vision"].device)
                n_image = int(image[i].sum())
                f[image[i]] = e["vision"][:n_image, width:]
                f[video[i]] = e["vision"][n_image:, width:]
                feats.append(f[visual[i]])
            joint = torch.cat(feats)  # batch order = the row-major order of hidden_states[visual]
            deepstack = {
                "visual_pos_masks": visual,
                "deepstack_visual_embeds": [
                    joint[:, width * j : width * (j + 1)].to(embeds.dtype) for j in range(k)
                ],
            }
        types, grid = self.mrope_inputs(ids, inputs)
        model = module.model
        model.rope_deltas = None  # never reuse positions cached by an earlier call
        positions = model.compute_3d_position_ids(
            input_ids=ids,
            inputs_embeds=embeds,
            image_grid_thw=grid,
            attention_mask=mask,
            mm_token_type_ids=types,
            **self.video_inputs(ids, inputs),
        )
        hidden = model.language_model(
            inputs_embeds=embeds, position_ids=positions, attention_mask=mask, use_cache=False, **deepstack
        ).last_hidden_state
        return module.lm_head(hidden)

    @classmethod
    def tiny_vision(cls, out_hidden: int) -> dict:
        # Qwen2.5-VL's tiny tower without windows, with a learned position grid and one DeepStack layer
        tower = super().tiny_vision(out_hidden)
        del tower["window_size"], tower["fullatt_block_indexes"]
        return {**tower, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}

    @classmethod
    def tiny_text(cls) -> dict:
        # head_dim 16 -> 8 rotary frequencies, interleaved over (t, h, w)
        return {
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        }


def patch_timestamps(frame_seconds: list[float], temporal: int) -> list[float]:
    """Seconds of each temporal patch, as ``Qwen3VLProcessor._calculate_timestamps``: the frames'
    list padded with its last entry to a multiple of ``temporal``, then the mean of each
    patch's first and last frame."""
    t = list(frame_seconds)
    if pad := -len(t) % temporal:
        t.extend(t[-1] for _ in range(pad))
    return [(t[i] + t[i + temporal - 1]) / 2 for i in range(0, len(t), temporal)]
