"""What every Hugging Face decoder family here shares: padding a microbatch,
scattering encoder embeddings at placeholder tokens, the tensor-parallel layer
map, checks against a degree, and export back to the dir's key names.

A family subclass says where the decoder lives in the module ``build`` returns
(``prefix``), which placeholder tokens it uses, and how to call the HF forward.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from disagg.interfaces import AttentionSpec, LanguageFamily, LayerMap, SequenceParallelRegions
from disagg.kit import context_parallel
from disagg.kit.hf import checkpoint_keys, empty_from_config

#: which first-party family reads a dir of each ``model_type`` (for "use family X" hints)
FAMILY_OF_MODEL_TYPE = {
    "qwen2": "qwen2",
    "llama": "llama",
    "llava": "llama",
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_5": "qwen3_5",
    "qwen2_audio": "qwen2_audio",
    "internvl": "internvl",
}


class HFDecoderFamily(LanguageFamily):
    """Base of the decoder families; subclasses set the class attributes."""

    @classmethod
    def planning_shape(cls, config, options=None, llm_hidden=None):  # type: ignore[no-untyped-def]
        from disagg_llm_tp.families.shapes import hf_decoder_shape

        return hf_decoder_shape(config)

    #: model_type values of whole multimodal dirs whose language model this family runs
    vlm_model_types: ClassVar[tuple[str, ...]] = ()
    #: model_type values of plain decoder dirs this family runs
    model_types: ClassVar[tuple[str, ...]] = ()
    #: module name -> placeholder token text, used when the config names no id
    placeholder_tokens: ClassVar[dict[str, str]] = {}
    #: module name -> config attributes that may hold the placeholder id
    placeholder_config_keys: ClassVar[dict[str, tuple[str, ...]]] = {
        "vision": ("image_token_id", "image_token_index"),
        "audio": ("audio_token_id", "audio_token_index"),
    }

    # -- config ----------------------------------------------------------------------------------------
    @property
    def config(self) -> Any:
        return self.hf_config()

    @property
    def is_vlm(self) -> bool:
        return self.config.model_type in self.vlm_model_types

    @property
    def text_config(self) -> Any:
        return self.config.get_text_config() if self.is_vlm else self.config

    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def prefix(self) -> str:
        """Dotted path of the decoder (embeddings + layers) in ``build()``'s module."""
        return "model.language_model" if self.is_vlm else "model"

    # -- building --------------------------------------------------------------------------------------
    def hf_class(self) -> type:
        """The transformers class of ``self.path``'s model (whole, towers included)."""
        raise NotImplementedError

    def prune(self, model: nn.Module) -> nn.Module:
        """Drop what other groups own (a VLM's vision tower); nothing by default."""
        return model

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        return self.prune(self.hf_class().from_pretrained(self.path, **self._load_kwargs(dtype)))

    def build_empty(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The same module on the meta device (the towers are dropped unbuilt too)."""
        return self.prune(empty_from_config(self.hf_class(), self.config, **self._load_kwargs(dtype)))

    def _load_kwargs(self, dtype: torch.dtype) -> dict[str, Any]:
        kw: dict[str, Any] = {"dtype": dtype}
        if "attn_implementation" in self.options:
            kw["attn_implementation"] = self.options["attn_implementation"]
        return kw

    # -- validation ------------------------------------------------------------------------------------
    def check(self, strategy: str, degree: int, replicas: int) -> list[str]:
        reads = (*self.model_types, *self.vlm_model_types)
        model_type = self.config.model_type
        if model_type not in reads:
            # Another model's config lacks the fields this family reads (a raw AttributeError later).
            other = FAMILY_OF_MODEL_TYPE.get(model_type)
            hint = f"; use family {other!r}" if other else ""
            return [
                f"model.llm.path={str(self.path)!r} is a {model_type!r} model, which family {self.name!r} "
                f"cannot read (it reads {', '.join(reads)}){hint}"
            ]
        # The heads a tensor-parallel degree must split are declared in layer_map().attention
        # (checked by the strategy that splits them); the vocabulary never blocks a degree:
        # megatron_tp pads it to a multiple of the degree.
        return []

    # -- tensor-parallel description --------------------------------------------------------------------
    def layer_map(self) -> LayerMap:
        tc, p = self.text_config, self.prefix
        attn = f"{p}.layers.*.self_attn"
        return LayerMap(
            column=(
                f"{attn}.q_proj",
                f"{attn}.k_proj",
                f"{attn}.v_proj",
                f"{p}.layers.*.mlp.gate_proj",
                f"{p}.layers.*.mlp.up_proj",
            ),
            row=(f"{attn}.o_proj", f"{p}.layers.*.mlp.down_proj"),
            vocab=(f"{p}.embed_tokens",),
            output=("lm_head",),
            heads={attn: self.head_attrs},
            attention={
                attn: AttentionSpec(
                    num_heads=tc.num_attention_heads,
                    num_kv_heads=tc.num_key_value_heads or tc.num_attention_heads,
                )
            },
            # Full copies on every TP rank (row-linear biases are replicated by construction).
            replicated=(
                f"{p}.layers.*.input_layernorm.*",
                f"{p}.layers.*.post_attention_layernorm.*",
                f"{p}.norm.*",
            ),
            # Sequence parallelism: the residual stream from the first layer's input on;
            # each norm's output is gathered for the column linears it feeds.
            sequence_parallel=SequenceParallelRegions(
                split=(f"{p}.layers.0",),
                gather=(
                    f"{p}.layers.*.input_layernorm",
                    f"{p}.layers.*.post_attention_layernorm",
                    f"{p}.norm",
                ),
                reduce_scatter=(f"{attn}.o_proj", f"{p}.layers.*.mlp.down_proj"),
            ),
            # the SwiGLU MLP reads the post-attention norm's output only (parallel.llm.mlp_tiles)
            mlp={f"{p}.layers.*.mlp": "post_attention_layernorm"},
        )

    def parts(self) -> dict[str, tuple[str, ...]]:
        # A tied lm_head is the embedding's weight: freezing either part freezes both.
        p = self.prefix
        return {
            "embed_tokens": (f"{p}.embed_tokens.*",),
            "layers": (f"{p}.layers.*",),
            "norm": (f"{p}.norm.*",),
            "lm_head": ("lm_head.*",),
        }

    #: attributes of the attention module holding the query-head count, if any
    head_attrs: ClassVar[tuple[str, ...]] = ()

    # -- placeholders ----------------------------------------------------------------------------------
    def placeholder_token_id(self, module: str) -> int:
        override = self.options.get("placeholder_tokens", {}).get(module)
        if override is None:
            for key in self.placeholder_config_keys.get(module, ()):
                value = getattr(self.config, key, None)
                if isinstance(value, int):
                    return value
        token = override or self.placeholder_tokens.get(module)
        if token is None:
            raise ValueError(
                f"family {self.name!r} has no placeholder token for module {module!r}; "
                f"set model.llm.options.placeholder_tokens.{module}; "
                f"known modules: {', '.join(self.placeholder_tokens)}"
            )
        tid = self.tokenizer().convert_tokens_to_ids(token)
        if tid is None or tid == self.tokenizer().unk_token_id:
            raise ValueError(
                f"placeholder token {token!r} for module {module!r} is not in the tokenizer of {self.path}"
            )
        return int(tid)

    @cached_property
    def _placeholder_ids(self) -> dict[str, int]:
        return {}

    def _pid(self, module: str) -> int:
        if module not in self._placeholder_ids:
            self._placeholder_ids[module] = self.placeholder_token_id(module)
        return self._placeholder_ids[module]

    # -- forward ---------------------------------------------------------------------------------------
    def pad_batch(
        self,
        inputs: list[dict[str, torch.Tensor]],
        device: torch.device,
        length: Callable[[int], int] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Right-pad ragged samples: ids, attention mask, labels (-100 on padding); ``length``:
        the padded length for the longest sample's (context parallelism pads further)."""
        n = max(int(x["input_ids"].shape[-1]) for x in inputs)
        n = length(n) if length is not None else n
        pad = self.text_config.pad_token_id
        pad = 0 if pad is None else int(pad)
        ids = torch.full((len(inputs), n), pad, dtype=torch.long, device=device)
        mask = torch.zeros((len(inputs), n), dtype=torch.long, device=device)
        labels = torch.full((len(inputs), n), -100, dtype=torch.long, device=device)
        for i, x in enumerate(inputs):
            length = int(x["input_ids"].shape[-1])
            ids[i, :length] = x["input_ids"].reshape(-1)
            labels[i, :length] = x["labels"].reshape(-1)
            mask[i, :length] = 1
        return ids, mask, labels

    def scatter(
        self, embeds: torch.Tensor, ids: torch.Tensor, rows: list[dict[str, torch.Tensor]]
    ) -> torch.Tensor:
        """Put each sample's encoder rows at its placeholder tokens, in order."""
        out = []
        for i, sample in enumerate(rows):
            e = embeds[i]
            for module, value in sample.items():
                where = ids[i] == self._pid(module)
                if int(where.sum()) != value.shape[0]:
                    raise ValueError(
                        f"sample {i} has {int(where.sum())} placeholder tokens for {module!r} "
                        f"but its encoder produced {value.shape[0]} rows"
                    )
                e = e.masked_scatter(where[:, None], value.to(e.dtype))
            out.append(e)
        return torch.stack(out)

    def forward(
        self,
        module: nn.Module,
        inputs: list[dict[str, torch.Tensor]],
        embeds: list[dict[str, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(module.parameters()).device
        cp = context_parallel.current()
        ids, mask, labels = self.pad_batch(inputs, device, cp.padded_length if cp is not None else None)
        x = self.scatter(module.get_input_embeddings()(ids), ids, self.placeholder_rows(embeds))
        if cp is not None:
            return self.forward_split(cp, module, ids, x, mask, labels, inputs)
        logits = self.run(module, ids, x, mask, inputs, embeds)
        logits = logits[:, :-1].reshape(-1, logits.shape[-1])
        return logits, labels[:, 1:].reshape(-1)

    # -- context parallelism (parallel.llm.context_parallel) --------------------------------------------
    context_parallel_support: ClassVar[bool] = True

    def forward_split(
        self,
        cp: context_parallel.ContextParallel,
        module: nn.Module,
        ids: torch.Tensor,
        embeds: torch.Tensor,
        mask: torch.Tensor,
        labels: torch.Tensor,
        inputs: list[dict[str, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the padded batch: positions are computed on the whole sequence
        and labels shifted (each token's label is the next token) *before* the load-balanced
        split, which then takes the same tokens of embeddings, positions and labels."""
        positions = self.position_ids(module, ids, mask, inputs)
        shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
        mine = cp.begin(ids.shape[1], ids.device)
        x = context_parallel.split(embeds, 1, mine)
        pos = context_parallel.split(positions, positions.dim() - 1, mine)
        logits = module(inputs_embeds=x, position_ids=pos, use_cache=False).logits
        local = context_parallel.split(shifted, 1, mine)
        return logits.reshape(-1, logits.shape[-1]), local.reshape(-1)

    def position_ids(
        self,
        module: nn.Module,
        ids: torch.Tensor,
        mask: torch.Tensor,
        inputs: list[dict[str, torch.Tensor]],
    ) -> torch.Tensor:
        """Rotary positions of the whole padded batch, as the HF forward computes them for
        right-padded samples: ``0 .. length - 1`` per row (families with multimodal RoPE
        override it with the model's own method)."""
        return torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)

    def placeholder_rows(self, rows: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """What is scattered at each sample's placeholder tokens: the encoder rows as they come
        (a family whose rows carry more than the embedding takes its part)."""
        return rows

    def run(
        self,
        module: nn.Module,
        ids: torch.Tensor,
        embeds: torch.Tensor,
        mask: torch.Tensor,
        inputs: list[dict[str, torch.Tensor]],
        rows: list[dict[str, torch.Tensor]],
    ) -> torch.Tensor:
        """Logits of the padded batch (HF forward from ``inputs_embeds``); ``rows``: the encoder
        rows per sample, as :meth:`forward` got them."""
        return module(inputs_embeds=embeds, attention_mask=mask, use_cache=False).logits

    # -- export ----------------------------------------------------------------------------------------
    def export_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in state.items():
            stored = self.checkpoint_name(name)
            if stored is not None:
                out[stored] = t
        return out

    @cached_property
    def _stored_keys(self) -> frozenset[str]:
        return frozenset(checkpoint_keys(self.path))

    def checkpoint_name(self, name: str) -> str | None:
        keys = self._stored_keys
        if name == "lm_head.weight" and "lm_head.weight" not in keys and self._tied():
            return None  # tied to the input embedding: HF saves it once
        return self._checkpoint_name(name, keys)

    def _tied(self) -> bool:
        return bool(
            getattr(self.config, "tie_word_embeddings", False)
            or getattr(self.text_config, "tie_word_embeddings", False)
        )

    def _checkpoint_name(self, name: str, keys: set[str]) -> str:
        if name in keys or not self.is_vlm:
            return name
        # Dirs saved before transformers 4.52 keep the decoder at "model.*"
        # (Qwen2.5-VL) or "language_model.model.*" (LLaVA).
        for old in ("model.", "language_model.model.", "language_model."):
            cand = (
                old + name[len("model.language_model.") :]
                if name.startswith("model.language_model.")
                else None
            )
            if cand and cand in keys:
                return cand
        if name == "lm_head.weight" and "language_model.lm_head.weight" in keys:
            return "language_model.lm_head.weight"
        return name


def write_hf_dir(src: Path, out: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Copy ``src``'s config/tokenizer/processor files and write ``tensors`` as
    ``model.safetensors`` (what ``disagg export`` does for one family)."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return out
