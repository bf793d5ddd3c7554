"""``whisper`` audio family: the encoder of a Whisper dir plus a projector into the LLM.

Options (``model.audio.options``):

- ``hidden_size``: width of the LLM the rows feed; default the LLM family's hidden size
  (set it only for an LLM family that does not report one).
- ``pooling``: ``avg`` (mean of ``stride`` neighbouring positions, as Qwen2-Audio)
  or ``stack`` (concatenate them, as Ultravox); default ``avg``.
- ``stride``: encoder positions per LLM row (50 per second of audio / stride); default 2.
- ``projector_seed``: seed of the projector's initialisation when the dir does
  not carry one (a plain Whisper checkpoint); default 0. Each weight row is drawn
  from its own generator (:mod:`.seeded`), so every rank builds the same
  projector, or under ``megatron_tp`` just its slices of it, on the meta device
  first like the encoder.
- ``attn_implementation`` (sdpa | eager | flash_attention_2), ``max_seconds``.

The projector (``linear_1`` -> GELU -> ``linear_2``, LLaVA's shape) is stored
under ``projector.`` next to the Whisper tensors by ``export``, so an exported
dir loads with Whisper's ``from_pretrained`` (the extra keys are ignored) and
rebuilds this family with the trained projector.

Windows are encoded trimmed to the positions their audio covers (as Ultravox
does) rather than padded to a full 30 s window: the placeholder count follows
the length, and a 2 s clip costs 2 s of encoder. A clip that fills its window
gives exactly HF ``WhisperEncoder``'s output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from disagg.interfaces import LayerMap
from disagg.interfaces.stored import StoredTensors
from disagg.kit.hf import checkpoint_keys, empty_from_config, find_prefix, quiet_transformers
from disagg_audio.families.encoder import WhisperStyleEncoder
from disagg_audio.families.seeded import Drawn, SeededTensors

POOLINGS = ("avg", "stack")
#: where the encoder lives in a Whisper dir's files (ForConditionalGeneration, WhisperModel, encoder-only)
_ENCODER_PREFIXES = ("model.encoder.", "encoder.", "")
PROJECTOR_PREFIX = "projector."


class AudioProjector(nn.Module):
    def __init__(self, in_features: int, hidden_size: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden_size)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class WhisperAudio(nn.Module):
    """What ``build`` returns: HF ``WhisperEncoder`` + projector."""

    def __init__(self, encoder: nn.Module, projector: AudioProjector) -> None:
        super().__init__()
        self.encoder = encoder
        self.projector = projector


class WhisperAudioFamily(WhisperStyleEncoder):
    name: ClassVar[str] = "whisper"

    @classmethod
    def planning_shape(cls, config, options=None, llm_hidden=None):  # type: ignore[no-untyped-def]
        from disagg_audio.families.shapes import whisper_shape

        return whisper_shape(config, options or {}, llm_hidden)

    # -- options and config ---------------------------------------------------------------------
    def encoder_config(self) -> Any:
        return self.hf_config()

    def stride(self) -> int:
        return int(self.options.get("stride", 2))

    def pooling(self) -> str:
        return str(self.options.get("pooling", "avg"))

    def unit(self) -> int:
        return self.stride()

    def hidden_size(self) -> int:
        if "hidden_size" not in self.options:
            raise ValueError(
                "model.audio.options.hidden_size is not set and the LLM family reports no hidden size: "
                "family 'whisper' needs it to size its projector"
            )
        return int(self.options["hidden_size"])

    def use_llm(self, llm: Any) -> None:
        """The projector maps to the LLM's width: take it from the LLM's config
        unless ``options.hidden_size`` says otherwise."""
        if "hidden_size" not in self.options:
            try:
                self.options["hidden_size"] = int(llm.hidden_size())
            except NotImplementedError:
                pass  # check() names the option to set

    def check(self, strategy: str, degree: int, replicas: int) -> list[str]:
        problems = []
        size = self.options.get("hidden_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            problems.append(
                f"model.audio.options.hidden_size={size!r}: family 'whisper' needs the LLM's hidden size "
                "(a positive int, e.g. 896 for Qwen2-0.5B) to size its projector; it is read from the "
                "LLM family when that reports one"
            )
        stride = self.options.get("stride", 2)
        if not isinstance(stride, int) or isinstance(stride, bool) or stride < 1:
            return problems + [
                f"model.audio.options.stride={stride!r} must be a positive int (positions per row)"
            ]
        if self.pooling() not in POOLINGS:
            problems.append(
                f"model.audio.options.pooling={self.pooling()!r} is not supported; "
                f"allowed: {', '.join(POOLINGS)}"
            )
        return problems + super().check(strategy, degree, replicas)

    # -- building -------------------------------------------------------------------------------
    def _projector_in(self) -> int:
        d = int(self.encoder_config().d_model)
        return d * self.stride() if self.pooling() == "stack" else d

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        with quiet_transformers():
            encoder = WhisperEncoder.from_pretrained(
                self.path,
                key_mapping={r"^model\.encoder\.": "", r"^encoder\.": ""},
                dtype=dtype,
                attn_implementation=self.options.get("attn_implementation", "sdpa"),
            )
        with torch.device("meta"):
            projector = AudioProjector(self._projector_in(), self.hidden_size())
        projector.to_empty(device="cpu")
        # the stored projector (an exported dir) or, in a plain one, the seeded draw: read
        # whole through what a rank loading its own slices reads (stored_tensors)
        source = self.stored_tensors()
        with torch.no_grad():
            for name, p in projector.named_parameters():
                p.copy_(source.read(PROJECTOR_PREFIX + name, dtype=p.dtype))
        return WhisperAudio(encoder, projector.to(dtype))

    def build_empty(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """``build()``'s module on the meta device: ``megatron_tp`` reads only its own slices
        of the encoder and of the projector, stored (an exported dir) or drawn (a plain one,
        :meth:`stored_tensors`)."""
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        attn = self.options.get("attn_implementation", "sdpa")
        encoder = empty_from_config(
            WhisperEncoder, self.encoder_config(), dtype=dtype, attn_implementation=attn
        )
        with torch.device("meta"):
            projector = AudioProjector(self._projector_in(), self.hidden_size()).to(dtype)
        self.stored_tensors()  # a stored projector of the wrong shape is refused here
        return WhisperAudio(encoder, projector)

    def stored_tensors(self) -> StoredTensors:
        """The dir's tensors; for a plain Whisper dir (no projector stored) the projector is
        drawn from ``projector_seed``, each weight row from its own generator (nn.Linear's
        default scale, ``U(-1/sqrt(in), 1/sqrt(in))``; zero biases), so a rank reads just its
        rows or columns and ``build`` the same values whole (:mod:`.seeded`)."""
        stored = StoredTensors(self.path)
        with torch.device("meta"):
            shapes = {
                PROJECTOR_PREFIX + k: tuple(v.shape)
                for k, v in AudioProjector(self._projector_in(), self.hidden_size()).state_dict().items()
            }
        keys = [k for k in stored.files if k.startswith(PROJECTOR_PREFIX)]
        if keys:
            self._check_projector(shapes, {k: tuple(stored.shape(k)) for k in keys})
            return stored
        drawn = {k: Drawn(s, s[1] ** -0.5 if len(s) == 2 else 0.0) for k, s in shapes.items()}
        return SeededTensors(self.path, drawn, int(self.options.get("projector_seed", 0)))

    def _check_projector(self, shapes: dict[str, tuple[int, ...]], got: dict[str, tuple[int, ...]]) -> None:
        if shapes != got:
            raise ValueError(
                f"{self.path}: the stored projector has shapes {got}, but model.audio.options "
                f"(hidden_size={self.hidden_size()}, pooling={self.pooling()!r}, stride={self.stride()}) "
                f"need {shapes}"
            )

    def checkpoint_name(self, name: str) -> str:
        # build()'s key_mapping for the encoder, the projector under its own prefix
        if name.startswith("encoder."):
            if getattr(self, "_prefix", None) is None:
                self._prefix = find_prefix(checkpoint_keys(self.path), "conv1.weight", _ENCODER_PREFIXES)
            return self._prefix + name[len("encoder.") :]
        if name.startswith("projector."):
            return PROJECTOR_PREFIX + name[len("projector.") :]
        raise KeyError(f"family 'whisper' cannot place tensor {name!r} in {self.path}")

    def tower(self, module: nn.Module) -> nn.Module:
        return module.encoder

    def tail(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        hidden = module.encoder.layer_norm(hidden)
        s = self.stride()
        if self.pooling() == "stack":
            pooled = hidden.reshape(-1, s * hidden.shape[-1])
        else:
            pooled = nn.functional.avg_pool1d(hidden.transpose(0, 1).unsqueeze(0), s, s)[0].transpose(0, 1)
        return module.projector(pooled)

    def layer_map(self) -> LayerMap:
        layers = "encoder.layers.*"
        return LayerMap(
            column=(
                f"{layers}.self_attn.q_proj",
                f"{layers}.self_attn.k_proj",
                f"{layers}.self_attn.v_proj",
                f"{layers}.fc1",
                "projector.linear_1",
            ),
            row=(f"{layers}.self_attn.out_proj", f"{layers}.fc2", "projector.linear_2"),
            heads={f"{layers}.self_attn": ("num_heads",)},
            attention=self.attention(f"{layers}.self_attn"),
            # the layer drops fc1's activations (column-split) before fc2 (rng.py of llm-tp)
            feature_split={layers: ("fc1", "fc2")},
            replicated=(
                "encoder.conv1.*",
                "encoder.conv2.*",
                "encoder.embed_positions.*",
                f"{layers}.self_attn_layer_norm.*",
                f"{layers}.final_layer_norm.*",
                "encoder.layer_norm.*",
            ),
        )

    def parts(self) -> dict[str, tuple[str, ...]]:
        return {"encoder": ("encoder.*",), "projector": ("projector.*",)}

    # -- export ---------------------------------------------------------------------------------
    def export_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.checkpoint_name(k): v for k, v in state.items()}

    @classmethod
    def make_tiny(cls, out_dir: Path, tokenizer_dir: Path | None = None) -> Path:
        from disagg_audio.families.tiny import make_tiny_whisper

        return make_tiny_whisper(Path(out_dir))
