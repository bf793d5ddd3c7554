"""What ``whisper`` and ``qwen2_audio`` share: a Whisper-style encoder tower
(two convolutions, absolute positions, pre-norm attention layers) over windows
of log-mel features, followed by a family-specific tail (pooling, norm,
projector) that turns every ``unit`` encoder positions into one LLM row.

Single process (``encode``) and ``ulysses`` run the same HF submodules:

- the convolution stem and position embeddings are per window (local), so a
  rank embeds only the windows that overlap its shard and keeps its positions;
- every attention layer attends within a window: one ``spanning`` segment per
  window, across shards;
- the tail pools ``unit`` neighbouring positions of one window; shard cuts fall
  on multiples of ``unit`` and windows hold a multiple of it, so no pooling
  group is ever split.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from disagg.interfaces import AttentionScope, AttentionSpec, EncoderFamily, SeqLayout, UlyssesFamily
from disagg.kit.hf import check_attn_implementation
from disagg_audio.features import feature_extractor, window_inputs


class WhisperStyleEncoder(UlyssesFamily, EncoderFamily):
    """Base of the audio families. Subclasses say where the tower lives, its
    config, how many positions make one row, and run the tail."""

    modality = "audio"

    # -- what a subclass provides ---------------------------------------------------------------
    @abstractmethod
    def encoder_config(self) -> Any:
        """The tower's HF config (``encoder_layers``, ``encoder_attention_heads``, ``d_model``...)."""

    @abstractmethod
    def tower(self, module: nn.Module) -> nn.Module:
        """The Whisper-style encoder inside ``build()``'s module."""

    @abstractmethod
    def unit(self) -> int:
        """Encoder positions per output row."""

    @abstractmethod
    def tail(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, d_model]`` encoder positions (n a multiple of ``unit``, whole
        pooling groups of one window or consecutive windows) -> ``[n // unit, hidden]`` rows."""

    # -- config checks --------------------------------------------------------------------------
    def max_seconds(self) -> float | None:
        value = self.options.get("max_seconds")
        return None if value is None else float(value)

    def check(self, strategy: str, degree: int, replicas: int) -> list[str]:
        problems = check_attn_implementation(self.options, "audio")
        cfg = self.encoder_config()
        if getattr(cfg, "encoder_layerdrop", 0.0):
            problems.append(
                f"encoder_layerdrop={cfg.encoder_layerdrop} in {self.path}/config.json is not supported "
                "(every rank must run every layer); set it to 0.0"
            )
        window = int(cfg.max_source_positions)
        if window % self.unit():
            problems.append(
                f"family {self.name!r}: the {window}-position window of {self.path} is not a multiple of "
                f"the {self.unit()} positions pooled into one row; choose a stride that divides {window}"
            )
        seconds = self.options.get("max_seconds")
        if seconds is not None and (not isinstance(seconds, (int, float)) or seconds <= 0):
            problems.append(
                f"model.audio.options.max_seconds={seconds!r} must be a positive number of seconds"
            )
        return problems

    def attention(self, pattern: str) -> dict[str, AttentionSpec]:
        """The layer map's head declaration for the attention modules ``pattern`` names:
        tensor parallelism splits their heads (ulysses checks its own degree against
        ``ulysses_heads``)."""
        return {pattern: AttentionSpec(num_heads=int(self.encoder_config().encoder_attention_heads))}

    # -- data -----------------------------------------------------------------------------------
    def preprocess(self, media: list[Any]) -> dict[str, torch.Tensor]:
        return window_inputs(media, feature_extractor(str(self.path)), self.unit(), self.max_seconds())

    def num_tokens(self, inputs: dict[str, torch.Tensor]) -> list[int]:
        rows = (inputs["positions"] // self.unit()).tolist()
        out, w = [], 0
        for n in inputs["windows"].tolist():
            out.append(int(sum(rows[w : w + n])))
            w += n
        return out

    # -- the shared forward pieces --------------------------------------------------------------
    def stem(self, module: nn.Module, features: torch.Tensor, positions: int) -> torch.Tensor:
        """One window's ``[n_mels, F]`` frames -> its first ``positions`` embedded
        positions ``[positions, d]`` (HF's convolutions, GELUs, absolute positions
        and embedding dropout)."""
        tower = self.tower(module)
        weight = tower.conv1.weight
        x = features[:, : 2 * positions + 1].to(weight.device, weight.dtype).unsqueeze(0)
        x = nn.functional.gelu(tower.conv1(x))
        x = nn.functional.gelu(tower.conv2(x))[0, :, :positions].transpose(0, 1)
        x = x + tower.embed_positions.weight[:positions]
        return nn.functional.dropout(x, p=tower.dropout, training=tower.training)

    def encode(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        tower = self.tower(module)
        rows = []
        for feats, n in zip(inputs["input_features"], inputs["positions"].tolist()):
            hidden = self.stem(module, feats, n).unsqueeze(0)
            for layer in tower.layers:
                hidden = layer(hidden, None)
            rows.append(self.tail(module, hidden[0]))
        return torch.cat(rows)

    # -- ulysses hook points --------------------------------------------------------------------
    def ulysses_heads(self) -> int:
        return int(self.encoder_config().encoder_attention_heads)

    def ulysses_layout(self, inputs: list[dict[str, torch.Tensor]]) -> SeqLayout:
        unit = self.unit()
        segments = [int(n) for x in inputs for n in x["positions"].tolist()]
        sample_rows = [int(x["positions"].sum()) // unit for x in inputs]
        n = sum(segments)
        row_sample = torch.repeat_interleave(torch.arange(len(inputs)), torch.tensor(sample_rows))
        starts = torch.tensor([0] + sample_rows).cumsum(0)
        return SeqLayout(
            n_tokens=n,
            # every whole row is a valid cut: windows hold whole rows and attention is per window
            cuts=list(range(0, n + 1, unit)),
            unit=unit,
            row_sample=row_sample,
            row_pos=torch.arange(n // unit) - starts[row_sample],
            sample_rows=sample_rows,
            extra={"segments": segments},
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
        tower = self.tower(module)
        features = [f for x in inputs for f in x["input_features"]]
        pieces, start = [], 0
        for feats, n in zip(features, layout.extra["segments"]):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:  # this window overlaps the shard: embed it, keep our positions
                pieces.append(self.stem(module, feats, n)[a - start : b - start])
            start += n
        weight = tower.conv1.weight
        # An empty shard still runs every layer: the all-to-alls need every rank.
        hidden = torch.cat(pieces) if pieces else weight.new_zeros(0, tower.config.d_model)
        hidden = hidden.unsqueeze(0)
        for layer in tower.layers:
            with scope.spanning(layout.extra["segments"]):
                hidden = layer(hidden, None)
        return self.tail(module, hidden[0])
