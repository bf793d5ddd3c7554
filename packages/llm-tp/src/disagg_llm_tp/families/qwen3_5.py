"""``qwen3_5`` (role llm): the hybrid decoder and ``lm_head`` inside a whole Qwen3.5 dir.

``build`` loads ``Qwen3_5ForConditionalGeneration`` and drops its tower (the
vision group owns it), so parameter names stay the checkpoint's and the
forward is HF's: ``Qwen3_5Model`` computes the interleaved mRoPE positions
from ``input_ids``, ``mm_token_type_ids`` and ``image_grid_thw`` and runs the
layers in ``layer_types`` order: gated-delta-net (linear attention) layers
and gated full-attention layers. The image rows the ``qwen3_5`` vision family
sends are one merged embedding per placeholder (no DeepStack).

Video is placed and positioned as Qwen3-VL's (``Qwen3_5Model.get_rope_index`` is
Qwen3-VL's, and Qwen3.5 dirs use ``Qwen3VLProcessor``): per temporal patch
``<t seconds><|vision_start|>`` + its ``<|video_pad|>`` tokens + ``<|vision_end|>``,
and the whole ``video_grid_thw`` with no ``second_per_grid_ts`` (which its
forward does not take).

What it runs under: ``ddp`` (and its ``shard``), ``zero`` and ``megatron_tp`` (with or
without sequence parallelism). Under ``megatron_tp`` the full-attention layers split as every
decoder's (gated ``q_proj``: each head's query and gate rows are contiguous, so a column
split keeps them together); each gated-delta-net layer is split by its heads by
:mod:`disagg_llm_tp.gdn` (declared in ``LayerMap.extra``, :mod:`disagg_llm_tp.module_split`):
its linear key heads and value heads must be divisible by the degree.

Refused, with the reason, before any actor starts: context parallelism. A linear-attention
layer carries a recurrent state along the whole sequence (and its causal conv looks back 3
tokens), so a rank holding a later slice needs every earlier rank's final state, which
``disagg.kit.context_parallel``'s K/V exchange does not pass.
"""

from __future__ import annotations

from typing import ClassVar

from disagg.interfaces import AttentionSpec, LayerMap, SequenceParallelRegions
from disagg_llm_tp.families.qwen2_5_vl import Qwen25VLLanguageFamily
from disagg_llm_tp.families.qwen3_vl import Qwen3VLLanguageFamily
from disagg_llm_tp.gdn import GatedDeltaNetSplit
from disagg_llm_tp.module_split import SPLITS


class Qwen35LanguageFamily(Qwen25VLLanguageFamily):
    name: ClassVar[str] = "qwen3_5"
    # transformers 5.17's Qwen3.5 model refuses input_ids beside inputs_embeds (this family hands
    # both: the ids place the mRoPE positions); 5.18 takes them (the tests pass there)
    requires_transformers: ClassVar[tuple[str, str] | None] = (
        "5.18",
        "its Qwen3.5 model refuses input_ids beside inputs_embeds before 5.18",
    )
    vlm_model_types: ClassVar[tuple[str, ...]] = ("qwen3_5",)
    # a linear-attention layer's recurrent state spans the whole sequence (module docstring)
    context_parallel_support: ClassVar[bool] = False
    # Qwen3.5's attention keeps no head count (it reshapes with -1)
    head_attrs: ClassVar[tuple[str, ...]] = ()
    # Qwen3-VL's video prompt (timestamped groups per temporal patch) and rope inputs
    video_placeholder_text = Qwen3VLLanguageFamily.video_placeholder_text
    video_inputs = Qwen3VLLanguageFamily.video_inputs

    @classmethod
    def hf_classes(cls) -> tuple[type, type]:
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        return Qwen3_5Config, Qwen3_5ForConditionalGeneration

    @classmethod
    def planning_shape(cls, config, options=None, llm_hidden=None):  # type: ignore[no-untyped-def]
        from disagg_llm_tp.families.qwen3_5_shape import qwen3_5_decoder_shape

        return qwen3_5_decoder_shape(config)

    def layer_map(self) -> LayerMap:
        """Every parameter's kind (what LoRA and the chunked loss read; the gated-delta-net
        linears are column/row there) and the split of each gated-delta-net layer by heads."""
        tc, p = self.text_config, self.prefix
        attn, lin = f"{p}.layers.*.self_attn", f"{p}.layers.*.linear_attn"
        heads = AttentionSpec(num_heads=tc.num_attention_heads, num_kv_heads=tc.num_key_value_heads)
        gdn = GatedDeltaNetSplit(
            key_heads=tc.linear_num_key_heads,
            value_heads=tc.linear_num_value_heads,
            key_head_dim=tc.linear_key_head_dim,
            value_head_dim=tc.linear_value_head_dim,
        )
        return LayerMap(
            column=(
                f"{attn}.q_proj",
                f"{attn}.k_proj",
                f"{attn}.v_proj",
                *(f"{lin}.in_proj_{x}" for x in ("qkv", "z", "b", "a")),
                f"{p}.layers.*.mlp.gate_proj",
                f"{p}.layers.*.mlp.up_proj",
            ),
            row=(f"{attn}.o_proj", f"{lin}.out_proj", f"{p}.layers.*.mlp.down_proj"),
            vocab=(f"{p}.embed_tokens",),
            output=("lm_head",),
            attention={attn: heads},
            replicated=(
                f"{p}.layers.*.input_layernorm.*",
                f"{p}.layers.*.post_attention_layernorm.*",
                f"{p}.norm.*",
            ),
            head_replicated=(f"{attn}.q_norm.*", f"{attn}.k_norm.*", f"{lin}.norm.*"),
            # the residual stream from the first layer on; either kind of token mixer reads a
            # gathered norm output and its row linear re-enters the region
            sequence_parallel=SequenceParallelRegions(
                split=(f"{p}.layers.0",),
                gather=(
                    f"{p}.layers.*.input_layernorm",
                    f"{p}.layers.*.post_attention_layernorm",
                    f"{p}.norm",
                ),
                reduce_scatter=(f"{attn}.o_proj", f"{lin}.out_proj", f"{p}.layers.*.mlp.down_proj"),
            ),
            extra={SPLITS: {lin: gdn}},
            # the dense MLP, never the gated delta net (it mixes tokens): parallel.llm.mlp_tiles
            mlp={f"{p}.layers.*.mlp": "post_attention_layernorm"},
        )

    @classmethod
    def tiny_vision(cls, out_hidden: int) -> dict:
        # Qwen3-VL's tiny tower (learned position grid) without windows or DeepStack
        tower = super().tiny_vision(out_hidden)
        del tower["window_size"], tower["fullatt_block_indexes"]
        return {**tower, "num_position_embeddings": 16}

    @classmethod
    def tiny_text(cls) -> dict:
        # both layer kinds (a linear one after the full one too), 2 key heads serving 4 value
        # heads in the linear layers; head_dim 16, half rotated: 4 frequencies over (t, h, w)
        return {
            "num_hidden_layers": 3,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
                "partial_rotary_factor": 0.5,
            },
        }
