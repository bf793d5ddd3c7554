"""Model families: how to build, feed and export one module from a Hugging Face dir.

Families stay close to Hugging Face: ``build`` returns the unpartitioned HF
module (loaded with ``from_pretrained``), ``encode``/``forward`` run it the way
the single-process HF model would. Parallel strategies never live here; a
family only *describes* its layers (``layer_map``) so that strategies can
rewrite them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from disagg.interfaces.stored import StoredTensors

Role = Literal["encoder", "llm"]


@dataclass(frozen=True)
class AttentionSpec:
    """One attention module's heads, which tensor parallelism splits over its ranks.

    The counts are what a strategy that splits heads checks its degree against
    before any actor starts; the attribute names are what it rewrites per rank.
    """

    #: query heads
    num_heads: int
    #: key/value heads (grouped-query attention); None: as many as query heads, nothing to group
    num_kv_heads: int | None = None
    #: child linears holding the key and value projections (replicated when fewer
    #: key/value heads than ranks)
    k: str = "k_proj"
    v: str = "v_proj"
    #: attribute of the attention module holding query heads per key/value head
    groups_attr: str = "num_key_value_groups"
    #: attribute holding the key/value head count, rewritten per rank where present
    kv_heads_attr: str | None = "num_key_value_heads"

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads


@dataclass(frozen=True)
class SequenceParallelRegions:
    """Where sequence parallelism cuts the residual stream (each a tuple of patterns).

    split: modules whose ``hidden_states`` input enters a region.
    gather: norms whose output leaves it (every column/output linear reads one).
    reduce_scatter: the row linears whose output re-enters it.
    """

    split: tuple[str, ...] = ()
    gather: tuple[str, ...] = ()
    reduce_scatter: tuple[str, ...] = ()


@dataclass(frozen=True)
class LayerMap:
    """Where tensor parallelism cuts a module; names are ``fnmatch`` patterns
    over ``module.named_modules()`` of the module ``Family.build`` returns
    (``replicated`` and ``head_replicated``: over ``named_parameters()``).

    column: linears split along output features (q/k/v, gate/up, fc1).
    row: linears split along input features (o_proj, down_proj, fc2).
    vocab: embeddings split along the vocabulary.
    output: linears split along the vocabulary whose output is the logits.
    heads: attention module pattern -> attribute names holding per-rank head
        counts (e.g. ``{"*.self_attn": ("num_heads", "num_key_value_heads")}``).
    attention: attention module pattern -> its head counts (:class:`AttentionSpec`):
        the heads a tensor-parallel degree must split (checked at validation).
    column_chunks: fused column linear pattern -> number of blocks split separately
        (a vision ``qkv`` is 3).
    sequence_parallel: the sequence-parallel regions, None when the family has none.
    replicated: parameters every TP rank holds in full (norms, patch/position
        embeddings); row-linear biases are replicated by construction.
    head_replicated: full copies each TP rank applies to its own heads only (per-head
        q/k norms): each rank holds part of their gradient.
    feature_split: layer pattern -> (first, last): child modules of each matching
        layer between whose output and input the activations are split by features
        (a column linear's output on its way to its row linear, e.g. Whisper's
        ``("fc1", "fc2")``, whose layer drops activations in between): dropout drawn
        there must differ per TP rank, as inside attention.
    extra: anything a third-party strategy needs beyond this (documented by it).
    no_split: pattern -> why tensor parallelism cannot cut those modules exactly yet; a
        strategy that splits by this map refuses the family with the reason (the map still
        names every parameter's kind for LoRA and the chunked loss).
    mlp: each block's per-token feed-forward module (pattern) -> the child name of the norm,
        a sibling in the same block, whose output is its one input ('' when not declared).
        ``parallel.<module>.mlp_tiles`` runs these modules over the sequence in tiles
        (:mod:`disagg.kit.recompute.tiled_mlp`), which is exact only for a module that mixes no
        tokens, so it is declared, never guessed (a gated-delta-net's row linear looks like an
        MLP's). Under Megatron sequence parallelism the norm's output is gathered per tile.
    """

    column: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    vocab: tuple[str, ...] = ()
    output: tuple[str, ...] = ()
    heads: dict[str, tuple[str, ...]] = field(default_factory=dict)
    attention: dict[str, AttentionSpec] = field(default_factory=dict)
    column_chunks: dict[str, int] = field(default_factory=dict)
    sequence_parallel: SequenceParallelRegions | None = None
    replicated: tuple[str, ...] = ()
    head_replicated: tuple[str, ...] = ()
    feature_split: dict[str, tuple[str, str]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    no_split: dict[str, str] = field(default_factory=dict)
    mlp: dict[str, str] = field(default_factory=dict)


class Family(ABC):
    """Base of every family. One instance per module, built from ``model.<module>``.

    Instances are created in the driver for validation and shipped to actors,
    so ``__init__`` must be cheap and picklable: read configs, not weights.
    """

    #: value of ``model.<module>.family``
    name: ClassVar[str]
    role: ClassVar[Role]
    #: ``(oldest transformers release, why)`` where the family needs a newer one than core's floor
    #: (the HF model class it drives changed since): config validation refuses an older one before
    #: any actor starts (:func:`disagg.kit.hf.transformers_problems`) instead of a failure deep in
    #: the model's forward on a rank
    requires_transformers: ClassVar[tuple[str, str] | None] = None

    def __init__(self, path: str | Path, options: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.options = dict(options or {})

    def hf_config(self) -> Any:
        """``self.path``'s ``config.json`` as transformers' ``AutoConfig`` reads it, parsed once per
        instance: a parse validates every field (tens of ms), and the data pipeline asks per
        sample (``num_tokens``), the planner per candidate layout. Kept with the instance (it
        travels to the actors with it); whoever builds a model from it gives the constructor a
        copy (:func:`disagg.kit.hf.empty_from_config` does; ``from_pretrained`` copies it itself)."""
        cached = self.__dict__.get("_hf_config")
        if cached is None:
            from transformers import AutoConfig

            cached = self.__dict__["_hf_config"] = AutoConfig.from_pretrained(self.path)
        return cached

    # -- validation, before any actor starts -------------------------------------------------
    def check(self, strategy: str, degree: int, replicas: int) -> list[str]:
        """Problems with running this family under ``strategy`` at ``degree``.

        Each string is one complete sentence naming the bad value and what
        would be allowed (e.g. "12 attention heads are not divisible by
        degree 5; use a divisor of 12: 1, 2, 3, 4, 6, 12").
        """
        return []

    # -- building -------------------------------------------------------------------------------
    @abstractmethod
    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The unpartitioned module, loaded from ``self.path`` with ``from_pretrained``."""

    def build_empty(self, dtype: torch.dtype = torch.float32) -> nn.Module | None:
        """``build()``'s module with its parameters (and persistent buffers) on the
        meta device, nothing read from ``self.path``: a strategy that holds only
        part of the module partitions it, then reads its own slices of the stored
        tensors (:class:`disagg.interfaces.stored.StoredTensors`, under the names
        :meth:`checkpoint_name` gives). ``None`` (the default): the family can only
        build its module loaded, and such strategies fall back to :meth:`build`."""
        return None

    def stored_tensors(self) -> StoredTensors:
        """What a strategy that loads its own slices reads: ``self.path``'s tensors; a family
        whose build draws a part the dir lacks (a plain Whisper dir's projector) adds it here,
        drawn so that any slice equals that slice of ``build()``'s."""
        return StoredTensors(self.path)

    def checkpoint_name(self, name: str) -> str | None:
        """The name under which the tensor ``name`` of ``build()``'s module is
        stored in ``self.path``'s safetensors files; ``None``: not stored (an
        output layer tied to the input embedding). The one map of names that
        loading slices and :meth:`export_state` share. Default: the same name."""
        return name

    def layer_map(self) -> LayerMap | None:
        """Tensor-parallel layer map, or None when the family cannot be split."""
        return None

    def parts(self) -> dict[str, tuple[str, ...]]:
        """Named parts of ``build()``'s module that ``train.modules.<m>.freeze``
        and ``train.modules.<m>.param_groups`` may name: part -> ``fnmatch``
        patterns over its parameter names, e.g. ``{"tower": ("patch_embed.*",
        "blocks.*"), "merger": ("merger.*",)}``. Parts may overlap (a coarse
        part and its pieces). Cheap: validation calls it before any actor starts."""
        return {}

    # -- export ---------------------------------------------------------------------------------
    @abstractmethod
    def export_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Map a full (merged) state dict of ``build()``'s module to the tensor
        names of the checkpoint files in ``self.path``, so that core can write
        an HF dir that ``from_pretrained`` loads (whole-VLM dirs get the keys of
        every family that came from them)."""

    @classmethod
    def planning_shape(
        cls, config: dict[str, Any], options: dict[str, Any] | None = None, llm_hidden: int | None = None
    ) -> Any:
        """This family's module as the cost hooks see it (an ``EncoderShape`` or
        ``DecoderShape``, :mod:`disagg.interfaces.shapes`) from its model dir's
        ``config.json`` values and ``model.<module>.options``; ``llm_hidden``: the
        LLM's width, for an encoder whose projector takes it from the LLM.
        ``None`` (the default): the family cannot be planned."""
        return None

    @classmethod
    def make_tiny(cls, out_dir: Path, tokenizer_dir: Path | None = None) -> Path:
        """Write a tiny random-weight HF dir for this family; return its path."""
        raise NotImplementedError(f"family {cls.name!r} has no tiny-model builder")

    @classmethod
    def tiny_variants(cls) -> dict[str, Any]:
        """Other tiny dirs ``disagg make-tiny`` writes for this family: dir name ->
        a callable ``(out_dir: Path) -> Path`` (e.g. ``llava_clip``: LLaVA with a
        CLIP tower, where ``make_tiny`` writes SigLIP)."""
        return {}


class EncoderFamily(Family):
    """A vision or audio encoder (projector included) that turns media into
    rows of language-model embeddings."""

    role: ClassVar[Role] = "encoder"
    #: media kind this encoder consumes: "image" or "audio"
    modality: ClassVar[str]
    #: True when ``preprocess`` takes ``min_pixels``/``max_pixels`` keywords (``data.min_pixels``
    #: / ``data.max_pixels``: the image area its processor resizes to); validation refuses
    #: those keys for families that leave it False (fixed-resolution encoders)
    pixel_limits: ClassVar[bool] = False
    #: True when the family also encodes video (``preprocess_video``): its rows come after the
    #: sample's image rows, and the LLM family places them at its ``video_token_id``
    reads_video: ClassVar[bool] = False
    #: how video frames are sampled (:data:`disagg.data.video.SAMPLERS`): ``qwen2_vl``
    #: (Qwen2/2.5-VL's processor), ``qwen3_vl`` (Qwen3-VL's) or ``internvl``
    #: (``InternVLVideoProcessor``'s)
    video_sampling: ClassVar[str] = "qwen2_vl"

    def video_frame_factor(self) -> int:
        """Frames per temporal patch: sampled frame counts are a multiple of it."""
        return 1

    def preprocess_video(self, videos: list[Any], **limits: int) -> dict[str, torch.Tensor]:
        """All videos of one sample (:class:`disagg.data.video.Video`, frames already sampled) ->
        input tensors merged into the sample's image inputs (their keys differ); called with
        ``min_pixels``/``max_pixels`` per frame when ``data.video_*_pixels`` are set. Only for
        ``reads_video`` families."""
        raise NotImplementedError(f"family {self.name!r} does not read video")

    @abstractmethod
    def preprocess(self, media: list[Any]) -> dict[str, torch.Tensor]:
        """All items of this modality in one sample -> the family's input tensors
        (CPU, float32). Runs in data workers, never in the driver. With
        ``pixel_limits`` it is called as ``preprocess(media, min_pixels=..,
        max_pixels=..)`` (only the keys that are set)."""

    @abstractmethod
    def num_tokens(self, inputs: dict[str, torch.Tensor]) -> list[int]:
        """Placeholder tokens each item of ``inputs`` becomes in the LLM."""

    @abstractmethod
    def encode(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Unpartitioned forward of one sample: ``[sum(num_tokens), llm_hidden]``."""

    def hidden_size(self) -> int:
        """Width of the rows ``encode`` returns (the LLM's hidden size)."""
        raise NotImplementedError

    def use_llm(self, llm: LanguageFamily) -> None:
        """Called with the run's LLM family once it is known, before ``check``
        (validation, ``families_for``): an encoder may take what it needs from
        it, e.g. the width its projector maps to. Keep it cheap and picklable."""
        return None


class LanguageFamily(Family):
    """A causal language model that consumes text plus encoder embeddings."""

    role: ClassVar[Role] = "llm"
    #: its ``forward`` splits the sequence over ``parallel.llm.context_parallel`` ranks
    #: (:mod:`disagg.kit.context_parallel`: positions on the whole sequence, then the
    #: load-balanced slice); a family without it is refused a context-parallel degree
    context_parallel_support: ClassVar[bool] = False

    def hidden_size(self) -> int:
        """Width of the embeddings the LLM consumes (what encoders project to)."""
        raise NotImplementedError

    def tokenizer(self) -> Any:
        """The HF tokenizer of ``self.path`` (``AutoTokenizer.from_pretrained``)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    @abstractmethod
    def placeholder_token_id(self, module: str) -> int:
        """Token id whose positions receive ``module``'s embeddings (read from
        the HF config/tokenizer, never hard-coded)."""

    def placeholder_text(self, module: str, n_tokens: int) -> str:
        """Text that stands for one media item in the prompt once expanded to
        ``n_tokens`` placeholders (families wrap it in their start/end tokens)."""
        tok = self.tokenizer().convert_ids_to_tokens(self.placeholder_token_id(module))
        return tok * n_tokens

    def video_token_id(self) -> int | None:
        """Token id whose positions receive the video rows of the ``reads_video`` encoder
        (after its image rows); None: this family does not take video."""
        return None

    def video_placeholder_text(self, n_tokens: int, timestamps: list[float] | None = None) -> str:
        """Text that stands for one video once expanded to ``n_tokens`` placeholders;
        ``timestamps``: the seconds of each sampled frame (for families that write them)."""
        raise NotImplementedError(f"family {self.name!r} does not take video")

    def extra_inputs(self, encoder_inputs: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Tensors the LLM needs from a sample's encoder inputs (e.g. image
        ``grid_thw`` for Qwen2.5-VL mRoPE). Keys are added to the LLM inputs."""
        return {}

    @abstractmethod
    def forward(
        self,
        module: nn.Module,
        inputs: list[dict[str, torch.Tensor]],
        embeds: list[dict[str, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the LLM on a microbatch.

        ``inputs[i]`` holds at least ``input_ids`` and ``labels`` ([L_i]);
        ``embeds[i][module]`` are the rows to scatter at that module's
        placeholder tokens, in order. Returns ``(logits, labels)`` already
        shifted and flattened (``[T, V_local]``, ``[T]`` with -100 ignored), so
        that the strategy owns the loss reduction (vocab-parallel CE for TP).
        """


def link_to_llm(families: dict[str, Family]) -> None:
    """Hand every encoder family the LLM family (``EncoderFamily.use_llm``)."""
    llm = families.get("llm")
    if isinstance(llm, LanguageFamily):
        for f in families.values():
            if isinstance(f, EncoderFamily):
                f.use_llm(llm)
