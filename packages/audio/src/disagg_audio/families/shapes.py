"""The audio families' encoders as the cost hooks see them (``Family.planning_shape``):
a Whisper-style encoder (two convolutions, the second of stride 2, then
``encoder_layers`` of full attention with GELU MLPs and LayerNorms) and the
family's tail turning ``unit`` encoder positions into one LLM row. ``seq_len``
counts encoder positions (after the stride-2 convolution: 1500 for 30 s)."""

from __future__ import annotations

from typing import Any

from disagg.interfaces.shapes import EncoderShape, ParamTensor, config_int


def _whisper_tensors(a: dict[str, Any]) -> tuple[list[ParamTensor], int, int]:
    d, f = config_int(a, "d_model"), config_int(a, "encoder_ffn_dim")
    mel, layers = config_int(a, "num_mel_bins"), config_int(a, "encoder_layers")
    params = [
        # conv1 runs at the input frame rate: two frames per encoder position
        ParamTensor("conv1.weight", (d, mel, 3), rows=(2, 1)),
        ParamTensor("conv1.bias", (d,)),
        ParamTensor("conv2.weight", (d, d, 3)),
        ParamTensor("conv2.bias", (d,)),
        ParamTensor("embed_positions.weight", (config_int(a, "max_source_positions"), d), rows=(0, 1)),
    ]
    for b in range(layers):
        p = f"layers.{b}."
        params += [
            ParamTensor(p + "self_attn.k_proj.weight", (d, d), "column"),
            ParamTensor(p + "self_attn.v_proj.weight", (d, d), "column"),
            ParamTensor(p + "self_attn.v_proj.bias", (d,), "column"),
            ParamTensor(p + "self_attn.q_proj.weight", (d, d), "column"),
            ParamTensor(p + "self_attn.q_proj.bias", (d,), "column"),
            ParamTensor(p + "self_attn.out_proj.weight", (d, d), "row"),
            ParamTensor(p + "self_attn.out_proj.bias", (d,)),
            ParamTensor(p + "self_attn_layer_norm.weight", (d,)),
            ParamTensor(p + "self_attn_layer_norm.bias", (d,)),
            ParamTensor(p + "fc1.weight", (f, d), "column"),
            ParamTensor(p + "fc1.bias", (f,), "column"),
            ParamTensor(p + "fc2.weight", (d, f), "row"),
            ParamTensor(p + "fc2.bias", (d,)),
            ParamTensor(p + "final_layer_norm.weight", (d,)),
            ParamTensor(p + "final_layer_norm.bias", (d,)),
        ]
    params += [ParamTensor("layer_norm.weight", (d,)), ParamTensor("layer_norm.bias", (d,))]
    return params, layers, mel


def _encoder(
    family: str, a: dict[str, Any], params: list[ParamTensor], layers: int, mel: int, out: int, unit: int
) -> EncoderShape:
    d = config_int(a, "d_model")
    return EncoderShape(
        family=family,
        hidden=d,
        heads=config_int(a, "encoder_attention_heads"),
        depth=layers,
        intermediate=config_int(a, "encoder_ffn_dim"),
        out_hidden=out,
        full_blocks=tuple(range(layers)),
        params=tuple(params),
        input_elems=2 * mel,
        pool=unit,
        mlp_in=1,
        mlp_mid=2,
        head_saves=3 * d + 2 + 3 * out // unit,  # the final norm and the projector, per position
    )


def whisper_shape(cfg: dict[str, Any], options: dict[str, Any], llm_hidden: int | None) -> EncoderShape:
    """``whisper``: the encoder, ``options.stride`` positions pooled (``avg``) or stacked
    (``stack``) per row, a two-layer GELU projector to the LLM's width."""
    params, layers, mel = _whisper_tensors(cfg)
    d = config_int(cfg, "d_model")
    stride = int(options.get("stride", 2))
    width = d * stride if options.get("pooling", "avg") == "stack" else d
    out = int(options.get("hidden_size") or llm_hidden or 0)
    if out <= 0:
        raise ValueError("family 'whisper' needs the LLM's width: set model.audio.options.hidden_size")
    per_row = (1, stride)
    params += [
        ParamTensor("projector.linear_1.weight", (out, width), "column", rows=per_row),
        ParamTensor("projector.linear_1.bias", (out,), "column"),
        ParamTensor("projector.linear_2.weight", (out, out), "row", rows=per_row),
        ParamTensor("projector.linear_2.bias", (out,)),
    ]
    return _encoder("whisper", cfg, params, layers, mel, out, stride)


def qwen2_audio_shape(cfg: dict[str, Any]) -> EncoderShape:
    """``qwen2_audio``: the Whisper-style tower, average pooling by 2, one linear
    projector to the LLM's width (``text_config.hidden_size``)."""
    a = cfg.get("audio_config") or {}
    params, layers, mel = _whisper_tensors(a)
    out = config_int(cfg.get("text_config") or {}, "hidden_size")
    params += [
        ParamTensor("multi_modal_projector.linear.weight", (out, config_int(a, "d_model")), rows=(1, 2)),
        ParamTensor("multi_modal_projector.linear.bias", (out,)),
    ]
    return _encoder("qwen2_audio", a, params, layers, mel, out, 2)


def qwen2_5_omni_audio_shape(cfg: dict[str, Any]) -> EncoderShape:
    """``qwen2_5_omni_audio``: the thinker's audio tower (a whole Omni dir's
    ``thinker_config.audio_config``): Whisper's layers with sinusoidal positions (a
    buffer, no parameter), the ``audio_bos_eos_token`` table (a lookup), then its own
    tail (``ln_post``, pooling by 2, ``proj`` to ``output_dim``). HF attends within
    windows of ``n_window`` positions; planned as full attention (an upper bound on
    attention FLOPs, exact on state and bytes)."""
    thinker = cfg.get("thinker_config") or cfg
    a = thinker.get("audio_config") or thinker
    params, layers, mel = _whisper_tensors(a)
    d, out = config_int(a, "d_model"), config_int(a, "output_dim")
    params = [t for t in params if not t.name.startswith(("embed_positions.", "layer_norm."))]
    params[4:4] = [ParamTensor("audio_bos_eos_token.weight", (2, out), rows=(0, 1))]
    per_row = (1, 2)
    params += [
        ParamTensor("ln_post.weight", (d,)),
        ParamTensor("ln_post.bias", (d,)),
        ParamTensor("proj.weight", (out, d), "replicated", rows=per_row),
        ParamTensor("proj.bias", (out,)),
    ]
    return _encoder("qwen2_5_omni_audio", a, params, layers, mel, out, 2)
