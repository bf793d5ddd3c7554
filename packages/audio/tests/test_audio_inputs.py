"""Real speech clips through decoding, resampling, windowing and log-mel features;
bad files fail with errors that name the file (and, through core's data
pipeline, the data line), never as silence."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile
import torch

from disagg.interfaces import LanguageFamily
from disagg_audio.decode import AudioError, decode_file, load_waveform
from disagg_audio.families.whisper import WhisperAudioFamily
from disagg_audio.features import feature_extractor


@pytest.mark.parametrize(
    "name,rate,seconds",
    [
        ("hello_44k.flac", 44100, 1.03),
        ("fox_16k.wav", 16000, 2.60),
        ("three_22k.ogg", 22050, 1.05),
        ("three_22k.mp3", 22050, 1.05),
    ],
)
def test_decode_formats(clips, name, rate, seconds):
    samples, got = decode_file(clips[name])
    assert got == rate and samples.dtype == np.float32 and samples.ndim == 1
    # mp3 adds encoder delay/padding frames; the words are all there either way
    assert samples.size / rate == pytest.approx(seconds, abs=0.06)
    assert 0.05 < np.abs(samples).max() <= 1.0  # speech, not silence


def test_resampling_keeps_the_speech(clips):
    """44.1 kHz -> 16 kHz: 16000 samples per second, same energy in the speech band."""
    raw, rate = decode_file(clips["hello_44k.flac"])
    out, name = load_waveform(str(clips["hello_44k.flac"]), 16000)
    assert name.endswith("hello_44k.flac")
    assert out.size == pytest.approx(raw.size * 16000 / rate, abs=2)
    assert np.sqrt(np.mean(out**2)) == pytest.approx(np.sqrt(np.mean(raw**2)), rel=0.05)
    same, _ = load_waveform(str(clips["fox_16k.wav"]), 16000)  # already at the rate: untouched
    np.testing.assert_array_equal(same, decode_file(clips["fox_16k.wav"])[0])


def test_speech_features_and_windows(clips, tiny_whisper):
    """The 2.6 s WAV fills two 1 s windows and part of a third; the FLAC one window.
    Features are the HF feature extractor's own for each window."""
    fam = WhisperAudioFamily(tiny_whisper, {"hidden_size": 24})
    x = fam.preprocess([str(clips["fox_16k.wav"]), str(clips["hello_44k.flac"])])
    assert x["windows"].tolist() == [3, 2]  # 1.03 s at 16 kHz spills 0.03 s into a second window
    assert x["positions"].tolist()[:2] == [50, 50] and x["positions"].tolist()[2] == 30
    assert fam.num_tokens(x) == [25 + 25 + 15, 25 + int(x["positions"][4]) // 2]
    fe = feature_extractor(str(tiny_whisper))
    wav, _ = load_waveform(str(clips["fox_16k.wav"]), 16000)
    ref = fe(wav[16000:32000], sampling_rate=16000, return_tensors="pt")["input_features"][0]
    torch.testing.assert_close(x["input_features"][1, :, :100], ref[:, :100])
    assert float(x["input_features"][:3].std()) > 0.1  # real structure, not padding


def test_bad_files(tmp_path, clips, tiny_whisper):
    fam = WhisperAudioFamily(tiny_whisper, {"hidden_size": 24, "max_seconds": 2.0})
    corrupt = tmp_path / "corrupt.flac"
    corrupt.write_bytes(clips["hello_44k.flac"].read_bytes()[:64] + b"\x00garbage" * 50)
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    silent = tmp_path / "no_samples.wav"
    soundfile.write(silent, np.zeros(0, dtype=np.float32), 16000)
    cases = {
        corrupt: "cannot decode audio",
        empty: "empty audio file",
        tmp_path / "missing.wav": "audio file not found",
        silent: "holds no samples",
        clips["fox_16k.wav"]: "exceeds model.audio.options.max_seconds=2.0",
    }
    for path, why in cases.items():
        with pytest.raises(AudioError, match=why) as info:
            fam.preprocess([str(path)])
        assert str(path) in str(info.value)


def test_pipeline_errors_name_file_and_line(tmp_path, clips, tiny_qwen2_audio):
    """Through core's per-sample preprocessing: the location (file:line) and the
    media file are both in the message; under on_error: skip the stream marks the
    same samples "skipped" at their location instead of failing (the data source
    then counts them: core's test_data_errors)."""
    from disagg.data.errors import DataError
    from disagg.data.preprocess import preprocess_record
    from disagg.data.records import read_dataset
    from disagg_audio.families.qwen2_audio import Qwen2AudioFamily

    (tmp_path / "corrupt.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt junk")
    (tmp_path / "empty.flac").write_bytes(b"")
    (tmp_path / "ok.flac").write_bytes(clips["hello_44k.flac"].read_bytes())

    def row(audio):
        return {
            "audio": audio,
            "conversations": [
                {"from": "human", "value": "<audio>\nWhat is said?"},
                {"from": "gpt", "value": "hello world"},
            ],
        }

    lines = [row("ok.flac"), row("corrupt.wav"), row("empty.flac"), row("missing.wav")]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    fam = Qwen2AudioFamily(tiny_qwen2_audio)
    families = {"audio": fam, "llm": _Qwen2AudioText(tiny_qwen2_audio)}
    bad: list[DataError] = []
    records = read_dataset(data, tmp_path, dataset=0, first_uid=0, modalities={"audio"}, on_bad=bad.append)
    # the missing file is caught while reading the dataset, before any decoding
    assert [str(e) for e in bad] == [
        f"{data}:4: missing audio file 'missing.wav' (looked for {tmp_path / 'missing.wav'})"
    ]
    tok = families["llm"].tokenizer()
    ok = preprocess_record(records[0], families, tok)
    assert ok.num_media_tokens == {"audio": sum(fam.num_tokens(ok.inputs["audio"]))} and ok.inputs["audio"]
    for rec, name in zip(records[1:], ["corrupt.wav", "empty.flac"]):
        with pytest.raises(DataError) as info:
            preprocess_record(rec, families, tok)
        assert str(info.value).startswith(f"{rec.source}:") and name in str(info.value)
    # the stream's per-sample step (what every data worker runs): with on_error: skip
    # the same files come back as "skipped" with their location (the source counts
    # them), with on_error: error as "error"; the good clip is "ok" either way
    from disagg.data.index import index_dataset
    from disagg.data.stream import StreamConfig, preprocess_one

    for policy, bad_status in (("skip", "skipped"), ("error", "error")):
        cfg = StreamConfig(
            families=families,
            modules=["audio", "llm"],
            modalities={"audio"},
            datasets=[index_dataset(data, tmp_path).spec()],
            max_tokens=None,
            on_too_long="error",
            on_error=policy,
            num_workers=1,
            prefetch_bytes=0,
        )
        got = []
        for i, r in enumerate(lines[:3]):
            meta, inputs = preprocess_one(cfg, i, i, 0, f"{data}:{i + 1}", 0, 0, json.dumps(r))
            got.append((meta["status"], meta.get("location"), inputs is None))
        assert got == [
            ("ok", None, False),
            (bad_status, f"{data}:2", True),
            (bad_status, f"{data}:3", True),
        ], policy


class _Qwen2AudioText(LanguageFamily):
    """The LLM side of the tiny Qwen2-Audio dir, as much as preprocessing needs
    (the real LLM families live in llm-tp, which this package must not need)."""

    name = "tiny_qwen2_audio_text"

    def placeholder_token_id(self, module):
        return self.tokenizer().convert_tokens_to_ids("<|AUDIO|>")

    def placeholder_text(self, module, n_tokens):
        return "<|audio_bos|>" + "<|AUDIO|>" * n_tokens + "<|audio_eos|>"

    def build(self, dtype=torch.float32):
        raise NotImplementedError("preprocessing only")

    def export_state(self, state):
        raise NotImplementedError("preprocessing only")

    def forward(self, module, inputs, embeds):
        raise NotImplementedError("preprocessing only")
