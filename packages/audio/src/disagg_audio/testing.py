"""Hugging Face's own audio forward, the reference of the audio families' tests.

What HF computes, and what the families add on top of it:

- **Qwen2-Audio** (``qwen2_audio``): ``Qwen2AudioEncoder`` over a window padded
  to its full length (``chunk_length`` seconds), the padded keys masked as
  ``Qwen2AudioModel.forward`` masks them (``feature_attention_mask`` ->
  ``_get_feat_extract_output_lengths`` -> ``create_bidirectional_mask``), then
  ``multi_modal_projector``, keeping the first ``output_lengths`` rows. The
  family's window is trimmed to the positions its audio covers, rounded up to
  an even count; HF gets the same clip with that rounding (at most 20 ms) as
  appended silence, through the feature extractor's own ``attention_mask``.
- **Whisper** (``whisper``): HF's ``WhisperEncoder`` reads only full windows and
  attends over the padding (its ``attention_mask`` is unused), so it defines a
  window's rows only when the audio fills it. A trimmed window (the
  family's choice, as Ultravox makes it) is HF's masked Whisper encoder:
  ``Qwen2AudioEncoder`` (HF's copy of ``WhisperEncoder`` that applies the mask)
  loaded with the Whisper dir's weights, read at its last layer (before its
  own pooling), then ``WhisperEncoder``'s final ``layer_norm``; on a full
  window this is exactly ``WhisperEncoder.forward`` (checked in
  ``tests/test_families.py``). Pooling: ``avg`` is ``AvgPool1d(stride)`` of
  that output; ``stack`` is Voxtral's ``get_audio_features`` reshape
  (``last_hidden_state.reshape(-1, k * d_model)``, Voxtral's ``k = 4``, here
  ``k = stride``). The projector is ``LlavaMultiModalProjector`` (linear, GELU,
  linear, with biases) holding the family's initial projector weights: a
  Whisper dir has no projector, so its initialisation (``projector_seed``) is
  the family's own definition.
- **Windows**: a clip longer than one window is cut into consecutive windows,
  each encoded on its own (HF's Qwen2-Audio processor would truncate it): every
  window is handed to HF as its own clip.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from disagg_audio.decode import load_waveform
from disagg_audio.features import conv_positions, feature_extractor


class HFAudioReference(nn.Module):
    """The HF modules of one audio family, named as the family's ``build()`` names
    them (so gradients and parameters compare key for key)."""

    def __init__(self, family: Any) -> None:
        super().__init__()
        self.family = family
        self.kind = family.name
        if self.kind == "qwen2_audio":
            from transformers import Qwen2AudioForConditionalGeneration

            hf = Qwen2AudioForConditionalGeneration.from_pretrained(family.path, dtype=torch.float32).model
            self.audio_tower = hf.audio_tower
            self.multi_modal_projector = hf.multi_modal_projector
        elif self.kind == "whisper":
            from transformers import Qwen2AudioEncoderConfig
            from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
            from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

            built = family.build(torch.float32)  # HF WhisperEncoder from the dir + the family's projector
            wcfg = built.encoder.config
            fields = (
                "num_mel_bins encoder_layers encoder_attention_heads encoder_ffn_dim d_model dropout "
                "attention_dropout activation_function activation_dropout scale_embedding "
                "max_source_positions"
            ).split()
            cfg = Qwen2AudioEncoderConfig(**{k: getattr(wcfg, k) for k in fields})
            cfg._attn_implementation = wcfg._attn_implementation  # noqa: SLF001
            self.encoder = Qwen2AudioEncoder(cfg)
            self.encoder.load_state_dict(built.encoder.state_dict())
            # trainable as WhisperEncoder.from_pretrained leaves them (embed_positions included)
            hf_params = dict(built.encoder.named_parameters())
            for n, p in self.encoder.named_parameters():
                p.requires_grad_(hf_params[n].requires_grad)
            proj_cfg = SimpleNamespace(
                vision_feature_layer=-1,
                vision_config=SimpleNamespace(hidden_size=built.projector.linear_1.in_features),
                text_config=SimpleNamespace(hidden_size=built.projector.linear_2.out_features),
                multimodal_projector_bias=True,
                projector_hidden_act="gelu",
            )
            self.projector = LlavaMultiModalProjector(proj_cfg)
            self.projector.load_state_dict(built.projector.state_dict())
        else:
            raise ValueError(f"no HF reference for audio family {family.name!r}")

    def tower(self) -> nn.Module:
        return self.audio_tower if self.kind == "qwen2_audio" else self.encoder

    # -- HF's inputs: each window a clip of its own, padded to the full window ----------------
    def hf_inputs(self, items: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_features`` ``[W, n_mels, full]`` and ``feature_attention_mask``
        ``[W, full]`` from the feature extractor, each window's audio extended
        with silence to the positions the family keeps (see the module doc)."""
        fe = feature_extractor(str(self.family.path))
        rate, size, hop = int(fe.sampling_rate), int(fe.n_samples), int(fe.hop_length)
        unit, full = self.family.unit(), int(fe.nb_max_frames) // 2
        chunks = []
        for item in items:
            samples, _ = load_waveform(item, rate, self.family.max_seconds())
            for i in range(0, samples.size, size):
                chunk = samples[i : i + size]
                frames = math.ceil(chunk.size / hop)
                kept = min(math.ceil(conv_positions(frames) / unit) * unit, full)
                if conv_positions(frames) < kept:  # the family's rounding, as silence HF pads with anyway
                    chunk = np.concatenate([chunk, np.zeros((2 * kept - 1) * hop - chunk.size, chunk.dtype)])
                chunks.append(chunk)
        out = fe(
            chunks, sampling_rate=rate, padding="max_length", return_attention_mask=True, return_tensors="pt"
        )
        return out["input_features"].to(torch.float32), out["attention_mask"].to(torch.long)

    # -- the forward ---------------------------------------------------------------------------------
    def _masked_tower(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """The tower's output and each window's rows, masked as ``Qwen2AudioModel.forward`` masks."""
        from transformers.masking_utils import create_bidirectional_mask

        tower = self.tower()
        feat_lengths, out_lengths = tower._get_feat_extract_output_lengths(mask.sum(-1))  # noqa: SLF001
        batch, _, mel = features.shape
        max_len = (mel - 2) // 2 + 1
        keep = (torch.arange(max_len)[None].expand(batch, max_len) < feat_lengths[:, None]).long()
        dummy = torch.zeros(batch, max_len, 1, dtype=features.dtype)
        attn = create_bidirectional_mask(config=tower.config, inputs_embeds=dummy, attention_mask=keep)
        if self.kind == "qwen2_audio":
            return tower(features, attention_mask=attn).last_hidden_state, out_lengths
        last: dict[str, torch.Tensor] = {}
        hook = tower.layers[-1].register_forward_hook(
            lambda m, a, o: last.update(h=o[0] if isinstance(o, tuple) else o)
        )
        try:
            tower(features, attention_mask=attn)
        finally:
            hook.remove()
        return tower.layer_norm(last["h"]), feat_lengths  # WhisperEncoder's final norm; rows per position

    def forward(self, items: list[Any]) -> torch.Tensor:
        """One sample's rows (every window of every item, in order)."""
        features, mask = self.hf_inputs(items)
        hidden, lengths = self._masked_tower(features, mask)
        if self.kind == "qwen2_audio":
            feats = self.multi_modal_projector(hidden)
            return torch.cat([feats[w, :n] for w, n in enumerate(lengths.tolist())])
        s, d = self.family.stride(), hidden.shape[-1]
        rows = []
        for w, n in enumerate(lengths.tolist()):
            h = hidden[w, :n]
            if self.family.pooling() == "stack":
                pooled = h.reshape(-1, s * d)  # Voxtral's stacking of consecutive positions
            else:
                pooled = nn.functional.avg_pool1d(h.T[None], s, s)[0].T
            rows.append(self.projector(pooled))
        return torch.cat(rows)


def hf_reference(family: Any, clips: list[list[Any]], grads: list[torch.Tensor]) -> tuple[list, dict]:
    """HF's rows of every sample (``clips``: per sample, its decoded items) and the
    parameter gradients of a backward from ``grads``; a parameter without a
    gradient stays absent (never zero-filled)."""
    module = HFAudioReference(family)
    module.train()
    outs = [module(items) for items in clips]
    torch.autograd.backward(outs, grads)
    pgrads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    return [o.detach() for o in outs], pgrads
