"""The vision families' towers as the cost hooks see them (``Family.planning_shape``):
numbers and parameter tensors from a ``config.json``'s values, no weights."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from disagg.interfaces.shapes import EncoderShape, ParamTensor, config_int


def qwen2_5_vl_shape(cfg: dict[str, Any]) -> EncoderShape:
    """A Qwen2.5-VL tower: patch embedding, blocks of window attention except
    ``fullatt_block_indexes``, RMSNorms, SwiGLU MLPs with biases, a 2x2 patch merger."""
    v = cfg.get("vision_config") or cfg
    h, i = config_int(v, "hidden_size", "embed_dim"), config_int(v, "intermediate_size")
    depth, out = config_int(v, "depth"), config_int(v, "out_hidden_size")
    patch, tp = config_int(v, "patch_size", "spatial_patch_size"), config_int(v, "temporal_patch_size")
    merge, chans = config_int(v, "spatial_merge_size"), int(v.get("in_channels", v.get("in_chans", 3)))
    if "fullatt_block_indexes" not in v:
        raise ValueError(f"config key 'fullatt_block_indexes' is missing (have: {', '.join(sorted(v))})")
    m = h * merge * merge
    params = [ParamTensor("patch_embed.proj.weight", (h, chans, tp, patch, patch))]
    for b in range(depth):
        p = f"blocks.{b}."
        params += [
            ParamTensor(p + "norm1.weight", (h,)),
            ParamTensor(p + "norm2.weight", (h,)),
            ParamTensor(p + "attn.qkv.weight", (3 * h, h), "column"),
            ParamTensor(p + "attn.qkv.bias", (3 * h,), "column"),
            ParamTensor(p + "attn.proj.weight", (h, h), "row"),
            ParamTensor(p + "attn.proj.bias", (h,)),
            ParamTensor(p + "mlp.gate_proj.weight", (i, h), "column"),
            ParamTensor(p + "mlp.gate_proj.bias", (i,), "column"),
            ParamTensor(p + "mlp.up_proj.weight", (i, h), "column"),
            ParamTensor(p + "mlp.up_proj.bias", (i,), "column"),
            ParamTensor(p + "mlp.down_proj.weight", (h, i), "row"),
            ParamTensor(p + "mlp.down_proj.bias", (h,)),
        ]
    merged = (1, merge * merge)
    params += [
        ParamTensor("merger.ln_q.weight", (h,)),
        ParamTensor("merger.mlp.0.weight", (m, m), "column", rows=merged),
        ParamTensor("merger.mlp.0.bias", (m,), "column"),
        ParamTensor("merger.mlp.2.weight", (out, m), "row", rows=merged),
        ParamTensor("merger.mlp.2.bias", (out,)),
    ]
    return EncoderShape(
        family="qwen2_5_vl",
        hidden=h,
        heads=config_int(v, "num_heads"),
        depth=depth,
        intermediate=i,
        out_hidden=out,
        full_blocks=tuple(v["fullatt_block_indexes"]),
        params=tuple(params),
        input_elems=chans * tp * patch**2,
        patch=patch,
        merge=merge,
        window=config_int(v, "window_size"),
    )


def qwen2_vl_shape(cfg: dict[str, Any]) -> EncoderShape:
    """A Qwen2-VL tower: full attention in every block, LayerNorms, a fc1/fc2 GELU
    MLP of ``mlp_ratio x embed_dim``, the same 2x2 merger (an estimate beyond state)."""
    v = cfg.get("vision_config") or cfg
    h = config_int(v, "embed_dim")
    i = int(h * float(v.get("mlp_ratio", 4)))
    depth, out = config_int(v, "depth"), config_int(v, "hidden_size")
    patch, tp = config_int(v, "patch_size"), config_int(v, "temporal_patch_size")
    merge, chans = config_int(v, "spatial_merge_size"), int(v.get("in_channels", v.get("in_chans", 3)))
    m = h * merge * merge
    params = [ParamTensor("patch_embed.proj.weight", (h, chans, tp, patch, patch))]
    for b in range(depth):
        p = f"blocks.{b}."
        params += [
            *(ParamTensor(p + f"norm{k}.{w}", (h,)) for k in (1, 2) for w in ("weight", "bias")),
            ParamTensor(p + "attn.qkv.weight", (3 * h, h), "column"),
            ParamTensor(p + "attn.qkv.bias", (3 * h,), "column"),
            ParamTensor(p + "attn.proj.weight", (h, h), "row"),
            ParamTensor(p + "attn.proj.bias", (h,)),
            ParamTensor(p + "mlp.fc1.weight", (i, h), "column"),
            ParamTensor(p + "mlp.fc1.bias", (i,), "column"),
            ParamTensor(p + "mlp.fc2.weight", (h, i), "row"),
            ParamTensor(p + "mlp.fc2.bias", (h,)),
        ]
    merged = (1, merge * merge)
    params += [
        ParamTensor("merger.ln_q.weight", (h,)),
        ParamTensor("merger.ln_q.bias", (h,)),
        ParamTensor("merger.mlp.0.weight", (m, m), "column", rows=merged),
        ParamTensor("merger.mlp.0.bias", (m,), "column"),
        ParamTensor("merger.mlp.2.weight", (out, m), "row", rows=merged),
        ParamTensor("merger.mlp.2.bias", (out,)),
    ]
    return EncoderShape(
        family="qwen2_vl",
        hidden=h,
        heads=config_int(v, "num_heads"),
        depth=depth,
        intermediate=i,
        out_hidden=out,
        full_blocks=tuple(range(depth)),
        params=tuple(params),
        input_elems=chans * tp * patch**2,
        patch=patch,
        merge=merge,
        mlp_in=1,
        mlp_mid=2,
    )


def llava_shape(cfg: dict[str, Any]) -> EncoderShape:
    """A LLaVA CLIP tower up to ``vision_feature_layer`` (later layers never run) and
    its two-layer GELU projector to the LLM's width; one row per patch, full attention
    in every layer, LayerNorms with biases (an estimate beyond state and bytes)."""
    v, t = cfg.get("vision_config") or {}, cfg.get("text_config") or {}
    h, i = config_int(v, "hidden_size"), config_int(v, "intermediate_size")
    out = config_int(t, "hidden_size")
    patch, chans = config_int(v, "patch_size"), int(v.get("num_channels", 3))
    n = config_int(v, "num_hidden_layers")
    layer = int(cfg.get("vision_feature_layer", -2))
    depth = layer if layer >= 0 else n + 1 + layer
    positions = (config_int(v, "image_size") // patch) ** 2 + 1
    params = [
        ParamTensor("embeddings.class_embedding", (h,)),
        ParamTensor("embeddings.patch_embedding.weight", (h, chans, patch, patch)),
        ParamTensor("embeddings.position_embedding.weight", (positions, h), rows=(0, 1)),  # a lookup
        ParamTensor("pre_layrnorm.weight", (h,)),
        ParamTensor("pre_layrnorm.bias", (h,)),
    ]
    for b in range(depth):
        p = f"encoder.layers.{b}."
        for proj in ("q_proj", "k_proj", "v_proj"):
            params += [
                ParamTensor(p + f"self_attn.{proj}.weight", (h, h), "column"),
                ParamTensor(p + f"self_attn.{proj}.bias", (h,), "column"),
            ]
        params += [
            ParamTensor(p + "self_attn.out_proj.weight", (h, h), "row"),
            ParamTensor(p + "self_attn.out_proj.bias", (h,)),
            *(ParamTensor(p + f"layer_norm{k}.{w}", (h,)) for k in (1, 2) for w in ("weight", "bias")),
            ParamTensor(p + "mlp.fc1.weight", (i, h), "column"),
            ParamTensor(p + "mlp.fc1.bias", (i,), "column"),
            ParamTensor(p + "mlp.fc2.weight", (h, i), "row"),
            ParamTensor(p + "mlp.fc2.bias", (h,)),
        ]
    params += [
        ParamTensor("multi_modal_projector.linear_1.weight", (out, h), "column"),
        ParamTensor("multi_modal_projector.linear_1.bias", (out,), "column"),
        ParamTensor("multi_modal_projector.linear_2.weight", (out, out), "row"),
        ParamTensor("multi_modal_projector.linear_2.bias", (out,)),
    ]
    return EncoderShape(
        family="llava",
        hidden=h,
        heads=config_int(v, "num_attention_heads"),
        depth=depth,
        intermediate=i,
        out_hidden=out,
        full_blocks=tuple(range(depth)),
        params=tuple(params),
        input_elems=chans * patch**2,
        patch=patch,
        mlp_in=1,
        mlp_mid=2,
        head_saves=h + 2 * out,  # the projector's input, linear_1's output and its activation
    )


def qwen3_vl_shape(cfg: dict[str, Any]) -> EncoderShape:
    """A Qwen3-VL tower: a biased patch embedding, a learned position grid (a lookup,
    resampled per token), full attention in every block, LayerNorms, a GELU
    ``linear_fc1``/``linear_fc2`` MLP, the 2x2 merger and one DeepStack merger per
    ``deepstack_visual_indexes`` entry (normed after the 2x2 shuffle, so over
    ``4·hidden``). Each exchanged row carries the merger's output and every DeepStack
    merger's (``(1 + K)·out_hidden_size`` wide, what the family's ``encode`` sends)."""
    v = cfg.get("vision_config") or cfg
    h, i = config_int(v, "hidden_size"), config_int(v, "intermediate_size")
    depth, out = config_int(v, "depth"), config_int(v, "out_hidden_size")
    patch, tp = config_int(v, "patch_size"), config_int(v, "temporal_patch_size")
    merge, chans = config_int(v, "spatial_merge_size"), int(v.get("in_channels", 3))
    if "deepstack_visual_indexes" not in v:
        raise ValueError(f"config key 'deepstack_visual_indexes' is missing (have: {', '.join(sorted(v))})")
    k = len(v["deepstack_visual_indexes"])
    positions = config_int(v, "num_position_embeddings")
    m = h * merge * merge
    params = [
        ParamTensor("patch_embed.proj.weight", (h, chans, tp, patch, patch)),
        ParamTensor("patch_embed.proj.bias", (h,)),
        # four bilinear neighbours looked up per token: no matmul
        ParamTensor("pos_embed.weight", (positions, h), rows=(0, 1)),
    ]
    for b in range(depth):
        p = f"blocks.{b}."
        params += [
            *(ParamTensor(p + f"norm{n}.{w}", (h,)) for n in (1, 2) for w in ("weight", "bias")),
            ParamTensor(p + "attn.qkv.weight", (3 * h, h), "column"),
            ParamTensor(p + "attn.qkv.bias", (3 * h,), "column"),
            ParamTensor(p + "attn.proj.weight", (h, h), "row"),
            ParamTensor(p + "attn.proj.bias", (h,)),
            ParamTensor(p + "mlp.linear_fc1.weight", (i, h), "column"),
            ParamTensor(p + "mlp.linear_fc1.bias", (i,), "column"),
            ParamTensor(p + "mlp.linear_fc2.weight", (h, i), "row"),
            ParamTensor(p + "mlp.linear_fc2.bias", (h,)),
        ]
    merged = (1, merge * merge)
    for prefix, norm in [("merger.", h), *((f"deepstack_merger_list.{j}.", m) for j in range(k))]:
        params += [
            ParamTensor(prefix + "norm.weight", (norm,)),
            ParamTensor(prefix + "norm.bias", (norm,)),
            ParamTensor(prefix + "linear_fc1.weight", (m, m), "column", rows=merged),
            ParamTensor(prefix + "linear_fc1.bias", (m,), "column"),
            ParamTensor(prefix + "linear_fc2.weight", (out, m), "row", rows=merged),
            ParamTensor(prefix + "linear_fc2.bias", (out,)),
        ]
    return EncoderShape(
        family="qwen3_vl",
        hidden=h,
        heads=config_int(v, "num_heads"),
        depth=depth,
        intermediate=i,
        out_hidden=out * (1 + k),
        full_blocks=tuple(range(depth)),
        params=tuple(params),
        input_elems=chans * tp * patch**2,
        patch=patch,
        merge=merge,
        mlp_in=1,
        mlp_mid=2,
        # every merger saves what the Qwen merger does (an estimate beyond state and bytes)
        head_saves=(1 + k) * (6 * h + 2),
    )


def qwen2_5_omni_vision_shape(cfg: dict[str, Any]) -> EncoderShape:
    """The Qwen2.5-Omni thinker's tower (a whole Omni dir's ``thinker_config.vision_config``):
    Qwen2.5-VL's with separate biased ``q``/``k``/``v`` linears in place of ``qkv``. Its
    RMSNorms upcast like Qwen2.5-VL's, so the cost rules see it as that family's tower."""
    thinker = cfg.get("thinker_config") or cfg
    base = qwen2_5_vl_shape(thinker.get("vision_config") or thinker)
    params: list[ParamTensor] = []
    for t in base.params:
        if ".attn.qkv." not in t.name:
            params.append(t)
            continue
        h = t.shape[0] // 3
        for p in ("q", "k", "v"):
            params.append(ParamTensor(t.name.replace(".qkv.", f".{p}."), (h, *t.shape[1:]), "column"))
    return replace(base, params=tuple(params))
