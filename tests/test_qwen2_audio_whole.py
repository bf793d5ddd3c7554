"""A whole Qwen2-Audio dir serves two modules: the ``qwen2_audio`` audio family
(tower + projector, disagg-audio) and the ``qwen2_audio`` LLM family (llm-tp).
Through the data pipeline (real speech clips decoded, resampled, windowed, the
chat template expanded with placeholder tokens) the two modules give
``Qwen2AudioForConditionalGeneration``'s own loss, and exporting both modules
writes back a dir the HF class loads whole."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_audio")

CLIPS = Path(__file__).parents[1] / "packages" / "audio" / "tests" / "data"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    import soundfile

    from disagg.data.preprocess import preprocess_record
    from disagg.data.records import Record
    from disagg_audio.families.qwen2_audio import Qwen2AudioFamily
    from disagg_llm_tp.families.qwen2_audio import Qwen2AudioLanguageFamily

    root = tmp_path_factory.mktemp("q2a")
    path = Qwen2AudioFamily.make_tiny(root / "qwen2_audio")
    # HF reads one window per clip (the tiny window is 1 s): clips under a second
    media = []
    for name, seconds in (("hello_44k.flac", 0.9), ("three_22k.ogg", 0.55), ("fox_16k.wav", 0.8)):
        data, rate = soundfile.read(CLIPS / name, dtype="float32")
        media.append(str(root / f"{name}.wav"))
        soundfile.write(media[-1], data[: int(seconds * rate)], rate)
    families = {"audio": Qwen2AudioFamily(path), "llm": Qwen2AudioLanguageFamily(path)}
    tok = families["llm"].tokenizer()
    records = [
        Record(
            0,
            0,
            "t.jsonl:1",
            [("user", "<audio>\nWhat is said?"), ("assistant", "hello world")],
            {"audio": media[:1]},
        ),
        Record(
            1,
            0,
            "t.jsonl:2",
            [("user", "<audio> then <audio>"), ("assistant", "one two three")],
            {"audio": media[1:]},
        ),
        Record(2, 0, "t.jsonl:3", [("user", "No sound."), ("assistant", "Nothing.")], {}),
    ]
    samples = [preprocess_record(r, families, tok).inputs for r in records]
    return path, families, samples, media


def test_two_modules_equal_hf_qwen2_audio(case):
    import numpy as np
    from transformers import Qwen2AudioForConditionalGeneration

    from disagg.data.media import load_audio
    from disagg.testing.reference import ReferenceModel
    from disagg_audio.decode import resample
    from disagg_audio.features import feature_extractor

    path, families, samples, media = case
    ref = ReferenceModel(families, {"audio": None, "llm": None})
    loss, n_total = ref.loss(samples)

    hf = Qwen2AudioForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    fe = feature_extractor(str(path))
    clips = iter(media)
    total = 0.0
    for s in samples:
        llm = s["llm"]
        kw = {"input_ids": llm["input_ids"][None], "labels": llm["labels"][None]}
        if "audio" in s:
            waves = []
            for _ in range(len(s["audio"]["windows"])):
                clip = load_audio(next(clips))
                waves.append(resample(clip["array"], clip["sampling_rate"], 16000))
            feats = fe(waves, sampling_rate=16000, return_tensors="pt")["input_features"]
            mask = torch.zeros(len(waves), feats.shape[-1], dtype=torch.long)
            for w, n in enumerate(s["audio"]["positions"].tolist()):
                mask[w, : 2 * n] = 1  # our rounding up to whole rows = that much more silence
            kw.update(input_features=feats, feature_attention_mask=mask)
        n = int((llm["labels"][1:] != -100).sum())
        total += float(hf(**kw).loss) * n
    assert float(loss) == pytest.approx(total / n_total, rel=1e-5)
    assert np.isfinite(total)


def test_export_writes_a_whole_dir(case, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2AudioForConditionalGeneration

    path, families, _, _ = case
    dest = tmp_path / "export"
    shutil.copytree(path, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    expected = {}
    for fam in families.values():
        module = fam.build()
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.5)
        exported = fam.export_state({k: v.detach().clone() for k, v in module.state_dict().items()})
        assert set(exported) <= set(tensors), sorted(set(exported) - set(tensors))[:5]
        tensors.update(exported)
        expected.update(exported)
    assert set(expected) == set(tensors)  # the two modules cover the whole dir
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(dest / "model.safetensors"),
        metadata={"format": "pt"},
    )
    hf = Qwen2AudioForConditionalGeneration.from_pretrained(dest, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "resaved")  # HF's own names for what it loaded
    saved = load_file(str(tmp_path / "resaved" / "model.safetensors"))
    for k, v in expected.items():
        assert torch.equal(saved[k], v), k
