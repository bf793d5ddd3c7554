"""``qwen2_audio`` (role llm): the Qwen2 language model and ``lm_head`` inside a
whole Qwen2-Audio dir; its audio tower and projector are the ``qwen2_audio``
audio family's (disagg-audio), so the same dir serves both modules and
``disagg export`` writes one dir that ``Qwen2AudioForConditionalGeneration``
loads whole.

``build`` loads ``Qwen2AudioForConditionalGeneration`` and drops the audio
side, so parameter names stay the checkpoint's (``model.language_model.*``,
``lm_head.weight``). ``run`` is what HF's forward does once the audio rows are
in ``inputs_embeds`` (the language model, then ``lm_head``), called directly
because ``Qwen2AudioModel.forward`` reads the dropped tower's device first.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from disagg_llm_tp.families.base import HFDecoderFamily


class Qwen2AudioLanguageFamily(HFDecoderFamily):
    #: its forward is not split yet (its own positions/run are untested under context parallelism)
    context_parallel_support: ClassVar[bool] = False

    name: ClassVar[str] = "qwen2_audio"
    # the export writes transformers 5.23's key names (``model.language_model.*``); 5.22's
    # Qwen2-Audio class saves and reads ``language_model.*`` (tests/test_qwen2_audio_whole.py)
    requires_transformers: ClassVar[tuple[str, str] | None] = (
        "5.23",
        "its export writes the key names Qwen2-Audio's class uses from 5.23",
    )
    vlm_model_types: ClassVar[tuple[str, ...]] = ("qwen2_audio",)
    placeholder_tokens: ClassVar[dict[str, str]] = {"audio": "<|AUDIO|>"}

    def hf_class(self) -> type:
        from transformers import Qwen2AudioForConditionalGeneration

        return Qwen2AudioForConditionalGeneration

    def prune(self, model: nn.Module) -> nn.Module:
        # owned by the audio group; not trained here
        model.model.audio_tower = None
        model.model.multi_modal_projector = None
        return model

    def run(self, module, ids, embeds, mask, inputs, rows):
        hidden = module.model.language_model(inputs_embeds=embeds, attention_mask=mask, use_cache=False)
        return module.lm_head(hidden.last_hidden_state)

    def placeholder_text(self, module: str, n_tokens: int) -> str:
        # Qwen2-Audio's prompt format: the expanded audio tokens between their bos/eos markers
        return "<|audio_bos|>" + "<|AUDIO|>" * n_tokens + "<|audio_eos|>"
