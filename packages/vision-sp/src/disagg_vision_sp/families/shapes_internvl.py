"""InternVL's tower as the cost hooks see it (``InternVLVision.planning_shape``): InternViT
and the pixel-shuffle projector from a ``config.json``'s values, no weights."""

from __future__ import annotations

from typing import Any

from disagg.interfaces.shapes import EncoderShape, ParamTensor, config_int


def _side(value: Any) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def internvl_shape(cfg: dict[str, Any]) -> EncoderShape:
    """InternViT: a biased patch embedding, a CLS token and learned absolute positions,
    full attention in every layer (optional q/k RMSNorms over the whole width), layer-scale
    vectors, LayerNorm or RMSNorm, a GELU ``fc1``/``fc2`` MLP; then a ``f x f`` pixel shuffle
    (``f = 1 / downsample_ratio``) and the LayerNorm + two-layer GELU projector to the LLM's
    width. One row per ``f²`` patches (the per-tile CLS token, 1 of ``1 + g²``, is left out
    of the token counts)."""
    v, t = cfg.get("vision_config") or {}, cfg.get("text_config") or {}
    h, i = config_int(v, "hidden_size"), config_int(v, "intermediate_size")
    n, out = config_int(v, "num_hidden_layers"), config_int(t, "hidden_size")
    patch, chans = _side(v.get("patch_size", 14)), int(v.get("num_channels", 3))
    side = _side(v.get("image_size", 448))
    f = round(1 / float(cfg.get("downsample_ratio", 0.5)))
    rms = v.get("norm_type", "layer_norm") == "rms_norm"
    bias = bool(v.get("attention_bias", False))
    params = [
        ParamTensor("embeddings.cls_token", (1, 1, h)),
        *([ParamTensor("embeddings.mask_token", (1, 1, h))] if v.get("use_mask_token", False) else []),
        ParamTensor("embeddings.patch_embeddings.projection.weight", (h, chans, patch, patch)),
        ParamTensor("embeddings.patch_embeddings.projection.bias", (h,)),
    ]
    if v.get("use_absolute_position_embeddings", True):
        params.append(ParamTensor("embeddings.position_embeddings", (1, (side // patch) ** 2 + 1, h)))
    for b in range(n):
        p = f"encoder.layer.{b}."
        for proj in ("q_proj", "k_proj", "v_proj"):
            params.append(ParamTensor(p + f"attention.{proj}.weight", (h, h), "column"))
            if bias:
                params.append(ParamTensor(p + f"attention.{proj}.bias", (h,), "column"))
        params += [
            ParamTensor(p + "attention.projection_layer.weight", (h, h), "row"),
            ParamTensor(p + "attention.projection_layer.bias", (h,)),
        ]
        if v.get("use_qk_norm", False):
            params += [ParamTensor(p + f"attention.{k}_norm.weight", (h,)) for k in ("q", "k")]
        params += [
            ParamTensor(p + "mlp.fc1.weight", (i, h), "column"),
            ParamTensor(p + "mlp.fc1.bias", (i,), "column"),
            ParamTensor(p + "mlp.fc2.weight", (h, i), "row"),
            ParamTensor(p + "mlp.fc2.bias", (h,)),
            ParamTensor(p + "lambda_1", (h,)),
            ParamTensor(p + "lambda_2", (h,)),
        ]
        for norm in ("layernorm_before", "layernorm_after"):
            params += [
                ParamTensor(p + f"{norm}.{w}", (h,)) for w in (("weight",) if rms else ("weight", "bias"))
            ]
    if not v.get("use_mean_pooling", True):
        params += [ParamTensor(f"layernorm.{w}", (h,)) for w in ("weight", "bias")]
    m, merged = h * f * f, (1, f * f)
    params += [
        ParamTensor("multi_modal_projector.layer_norm.weight", (m,)),
        ParamTensor("multi_modal_projector.layer_norm.bias", (m,)),
        ParamTensor("multi_modal_projector.linear_1.weight", (out, m), "column", rows=merged),
        ParamTensor("multi_modal_projector.linear_1.bias", (out,), "column"),
        ParamTensor("multi_modal_projector.linear_2.weight", (out, out), "row", rows=merged),
        ParamTensor("multi_modal_projector.linear_2.bias", (out,)),
    ]
    return EncoderShape(
        family="internvl",
        hidden=h,
        heads=config_int(v, "num_attention_heads"),
        depth=n,
        intermediate=i,
        out_hidden=out,
        full_blocks=tuple(range(n)),
        params=tuple(params),
        input_elems=chans * patch**2,
        patch=patch,
        merge=f,
        mlp_in=1,
        mlp_mid=2,
        # per patch token: the shuffled projector input (normed and not) and linear_1's
        # output and activation per merged row
        head_saves=2 * h + 2 * out // (f * f),
    )
