"""The demo dataset generator and ``disagg make-tiny`` with core's toy families."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from disagg.cli.make_tiny import make_tiny
from disagg.data.demo_data import make_demo_data
from disagg.data.media import load_audio, load_image
from disagg.data.records import read_dataset
from disagg.plugins import build_registry, make_plugin_manager
from disagg.testing import toy
from disagg.tiny import COLOURS, SHAPES


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_demo_data_is_deterministic_and_readable(tmp_path: Path):
    a = make_demo_data(tmp_path / "a", train_per_class=2, eval_per_class=1, audio=True)
    make_demo_data(tmp_path / "b", train_per_class=2, eval_per_class=1, audio=True)
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    assert set(a) == {"train", "eval", "audio_train", "audio_eval", "omni_train", "omni_eval"}

    def bad(err):
        raise err

    train = read_dataset(a["train"], tmp_path / "a", dataset=0, first_uid=0, modalities={"image"}, on_bad=bad)
    held = read_dataset(a["eval"], tmp_path / "a", dataset=0, first_uid=0, modalities={"image"}, on_bad=bad)
    assert len(train) == 2 * len(COLOURS) * len(SHAPES) and len(held) == len(COLOURS) * len(SHAPES)
    captions = {r.messages[-1][1] for r in train}
    assert captions == {f"A {c} {s}." for c in COLOURS for s in SHAPES}
    # held-out images are new drawings, not copies of training ones
    train_pixels = {load_image(r.media["image"][0]).tobytes() for r in train}
    assert not any(load_image(r.media["image"][0]).tobytes() in train_pixels for r in held)
    assert load_image(train[0].media["image"][0]).size == (48, 48)

    tones = read_dataset(
        a["audio_train"], tmp_path / "a", dataset=0, first_uid=0, modalities={"audio"}, on_bad=bad
    )
    clip = load_audio(tones[0].media["audio"][0])
    omni = read_dataset(
        a["omni_train"], tmp_path / "a", dataset=0, first_uid=0, modalities={"image", "audio"}, on_bad=bad
    )
    kinds = [tuple(sorted(r.media)) for r in omni]
    # every four consecutive samples: image-only, audio-only, image+audio, text-only
    assert kinds[:4] == [("image",), ("audio",), ("audio", "image"), ()] and len(omni) == len(train)
    assert (
        clip["sampling_rate"] == 16000 and clip["array"].shape == (8000,) and abs(clip["array"]).max() <= 1.0
    )


def test_make_tiny_writes_every_family_once(tmp_path: Path):
    pm, failures = make_plugin_manager(load_entry_points=False)
    pm.register(toy, name="toy")
    reg = build_registry(pm, failures)
    manifest = make_tiny(tmp_path, train_per_class=1, eval_per_class=1, registry=reg)
    # "toy" is registered for both roles: one dir, written by the encoder side
    assert manifest["models"] == {"toy": str(tmp_path / "toy")}
    assert json.loads((tmp_path / "toy" / "config.json").read_text())["model_type"] == "disagg_toy_encoder"
    assert Path(manifest["data"]["train"]).is_file() and "audio_train" not in manifest["data"]
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest


def test_make_tiny_unknown_family_is_named(tmp_path: Path):
    import pytest

    pm, failures = make_plugin_manager(load_entry_points=False)
    pm.register(toy, name="toy")
    with pytest.raises(ValueError, match=r"--families: unknown family 'nope'; installed: toy"):
        make_tiny(tmp_path, ["nope"], registry=build_registry(pm, failures))
