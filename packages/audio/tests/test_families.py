"""The audio families load from HF dirs, equal HF's own modules, export back,
and register as plugins."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from harness import ragged_clips, rel

from disagg_audio.families.qwen2_audio import Qwen2AudioFamily
from disagg_audio.families.whisper import WhisperAudioFamily


def test_whisper_full_window_equals_hf_encoder(tiny_whisper):
    """A clip that fills its window: HF WhisperEncoder's forward (padded 30 s
    semantics), then our pooling and projector, gives ``encode``'s rows."""
    fam = WhisperAudioFamily(tiny_whisper, {"hidden_size": 24})
    x = fam.preprocess(ragged_clips([[1.0]])[0])
    assert x["positions"].tolist() == [50]
    module = fam.build().eval()
    hf = module.encoder(x["input_features"][:, :, :100]).last_hidden_state[0]
    pooled = torch.nn.functional.avg_pool1d(hf.T[None], 2, 2)[0].T
    assert rel(fam.encode(module, x), module.projector(pooled)) <= 1e-6


def test_hf_reference_is_whisper_encoder_where_whisper_defines_it(tiny_whisper):
    """The Whisper reference of the parallel tests (``disagg_audio.testing``) is HF's
    ``WhisperEncoder.forward`` on full windows, stacked as Voxtral stacks; on a
    trimmed window ``WhisperEncoder`` (which attends over the padding) differs:
    trimming is the family's definition, and the reference masks the padding
    as HF's Qwen2-Audio does."""
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    from disagg.testing.tolerance import assert_tensor_close
    from disagg_audio.testing import HFAudioReference

    fam = WhisperAudioFamily(tiny_whisper, {"hidden_size": 24, "pooling": "stack", "stride": 5})
    ref = HFAudioReference(fam).eval()
    whisper = WhisperEncoder.from_pretrained(tiny_whisper, key_mapping={r"^model\.encoder\.": ""}).eval()
    with torch.no_grad():
        for seconds, full in (([2.0], True), ([0.45], False)):
            items = ragged_clips([seconds])[0]
            features, mask = ref.hf_inputs(items)
            hf = whisper(features).last_hidden_state
            hidden, lengths = ref._masked_tower(features, mask)  # noqa: SLF001
            if full:
                assert lengths.tolist() == [50, 50]
                assert_tensor_close(hidden, hf, "masked encoder vs WhisperEncoder.forward")
                stacked = ref.projector(hf.reshape(-1, 5 * hf.shape[-1]))  # Voxtral's get_audio_features
                assert_tensor_close(ref(items), stacked, "stacked rows")
            else:
                (n,) = lengths.tolist()
                assert n < 50 and rel(hidden[0, :n], hf[0, :n]) > 1e-3, "HF Whisper attends the padding"


def test_qwen2_audio_equals_hf_masked_path(tiny_qwen2_audio):
    """HF pads every window to 30 s (here 1 s) and masks the padding; the
    rows it keeps equal ours, for windows of every length (ragged clips)."""
    from transformers import Qwen2AudioForConditionalGeneration

    fam = Qwen2AudioFamily(tiny_qwen2_audio)
    hf = Qwen2AudioForConditionalGeneration.from_pretrained(tiny_qwen2_audio).eval().model
    module = fam.build().eval()
    fe_frames = 100
    for items in ragged_clips([[2.3], [0.45, 0.03]], seed=3):
        x = fam.preprocess(items)
        ours = fam.encode(module, x)
        # what HF gets for the same audio: full padded windows + feature_attention_mask
        from disagg_audio.features import feature_extractor

        fe = feature_extractor(str(tiny_qwen2_audio))
        chunks = [c["array"][i : i + 16000] for c in items for i in range(0, c["array"].size, 16000)]
        full = torch.from_numpy(fe(chunks, sampling_rate=16000, return_tensors="np")["input_features"])
        mask = torch.zeros(len(chunks), fe_frames, dtype=torch.long)
        for w, n in enumerate(x["positions"].tolist()):
            mask[w, : 2 * n] = 1  # n positions <- 2n frames (our rounding = appended silence)
        _, out_len = hf.audio_tower._get_feat_extract_output_lengths(mask.sum(-1))
        lengths = (mask.sum(-1) - 1) // 2 + 1
        keys = torch.arange(fe_frames // 2)[None] < lengths[:, None]
        attn = torch.zeros(len(chunks), 1, fe_frames // 2, fe_frames // 2)
        attn.masked_fill_(~keys[:, None, None, :], float("-inf"))
        feats = hf.multi_modal_projector(hf.audio_tower(full, attention_mask=attn).last_hidden_state)
        theirs = torch.cat([feats[w, :n] for w, n in enumerate(out_len.tolist())])
        assert ours.shape == theirs.shape and rel(ours, theirs) <= 1e-6


def test_whisper_options_and_check(tiny_whisper):
    bad = WhisperAudioFamily(tiny_whisper, {"pooling": "max", "stride": 3, "max_seconds": -1})
    problems = " | ".join(bad.check("ddp", 1, 1))
    assert "model.audio.options.hidden_size=None" in problems
    assert "pooling='max' is not supported; allowed: avg, stack" in problems
    assert "50-position window" in problems and "stride that divides 50" in problems
    assert "max_seconds=-1" in problems
    assert WhisperAudioFamily(tiny_whisper, {"hidden_size": 24, "stride": 5}).check("ulysses", 2, 1) == []
    # the family declares its heads (layer_map().attention); the strategy that splits them checks
    from disagg_llm_tp.strategy import MegatronTPOptions, MegatronTPStrategy

    tp_family = WhisperAudioFamily(tiny_whisper, {"hidden_size": 24})
    assert tp_family.check("megatron_tp", 3, 1) == []
    (tp,) = MegatronTPStrategy.check(tp_family, 3, 1, MegatronTPOptions())
    assert tp.startswith("4 attention heads") and "degree 3" in tp and tp.endswith("1, 2, 4")


@pytest.mark.parametrize("which", ["whisper", "qwen2_audio"])
def test_export_round_trip(which, tiny_whisper, tiny_qwen2_audio, tmp_path):
    """Trained weights exported to the dir's layout load back (projector included),
    and the whole HF model still loads from the exported dir."""
    from safetensors.torch import load_file, save_file

    if which == "whisper":
        src, fam = tiny_whisper, WhisperAudioFamily(tiny_whisper, {"hidden_size": 24})
    else:
        src, fam = tiny_qwen2_audio, Qwen2AudioFamily(tiny_qwen2_audio)
    module = fam.build()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.01)
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    dest = tmp_path / which
    shutil.copytree(src, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    exported = fam.export_state(state)
    assert set(exported) - set(tensors) <= {k for k in exported if k.startswith("projector.")}
    tensors.update(exported)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(dest / "model.safetensors"),
        metadata={"format": "pt"},
    )
    again = type(fam)(dest, fam.options).build().state_dict()
    for k, v in state.items():
        assert torch.equal(again[k], v), k
    from transformers import AutoModel

    AutoModel.from_pretrained(dest)  # still a whole HF dir


def test_plugin_registers_both(monkeypatch):
    from disagg.plugins import build_registry, make_plugin_manager

    monkeypatch.setenv("DISAGG_PLUGINS", "audio")
    reg = build_registry(*make_plugin_manager())
    assert reg.failures == {}
    assert reg.families[("encoder", "whisper")] is WhisperAudioFamily
    assert reg.families[("encoder", "qwen2_audio")] is Qwen2AudioFamily


def test_make_tiny_builds_audio_models_and_data(tmp_path, monkeypatch):
    """``disagg make-tiny`` builds the tiny audio dir and, with an audio family
    installed, the audio dataset, whose clips the family reads."""
    import json

    from disagg.cli.make_tiny import make_tiny
    from disagg.plugins import build_registry, make_plugin_manager

    monkeypatch.setenv("DISAGG_PLUGINS", "audio")
    reg = build_registry(*make_plugin_manager())
    manifest = make_tiny(
        tmp_path, ["whisper"], train_per_class=1, eval_per_class=1, image_size=16, registry=reg
    )
    assert (tmp_path / "whisper" / "preprocessor_config.json").is_file()
    fam = WhisperAudioFamily(manifest["models"]["whisper"], {"hidden_size": 8})
    rows = [json.loads(x) for x in open(manifest["data"]["audio_train"])]
    assert rows and all("<audio>" in r["conversations"][0]["value"] for r in rows)
    x = fam.preprocess([str(tmp_path / "data" / rows[0]["audio"])])
    assert fam.encode(fam.build(), x).shape == (sum(fam.num_tokens(x)), 8)
    x = fam.preprocess([{"array": np.ones(8000, np.float32) * 0.1, "sampling_rate": 16000}])
    assert fam.num_tokens(x) == [13]  # 0.5 s: 50 frames -> 25 positions -> 26 -> 13 rows
