"""``disagg export`` of a model composed of separate dirs: one HF dir per source
plus ``disagg_model.json``, from which each module is rebuilt through its
family (``from_pretrained``) with the trained weights and the same options.

The checkpoint is written by hand in the full form the actors write (no Ray):
what is under test is export, not training.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from disagg.config.schema import Config
from disagg.runtime.actor.state import file_digest
from disagg.runtime.checkpoint import FORMAT as CKPT_FORMAT
from disagg.runtime.checkpoint import layout_of
from disagg.runtime.export import MANIFEST, export_checkpoint, load_exported, model_section, read_manifest
from disagg.testing import toy
from disagg.testing.tolerance import assert_exact
from disagg.testing.toy import make_toy_dirs


@pytest.fixture
def toy_registry(disagg_registry):
    from disagg.plugins import register_plugin

    return register_plugin(toy, name="disagg.testing.toy")


def _fake_checkpoint(tmp_path: Path, registry) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    """A complete ``step-3`` checkpoint whose weights differ from the source dirs'."""
    enc, lm = make_toy_dirs(tmp_path / "models")
    cfg = Config.model_validate(
        {
            "model": {
                "vision": {"family": "toy", "path": str(enc), "options": {"note": "kept"}},
                "llm": {"family": "toy", "path": str(lm)},
            },
            "output_dir": str(tmp_path / "run"),
        }
    )
    ckpt = tmp_path / "run" / "checkpoints" / "step-3"
    trained, files = {}, {}
    for m in ("vision", "llm"):
        fam = registry.family("encoder" if m == "vision" else "llm", "toy")(getattr(cfg.model, m).path)
        state = {k: v + 0.5 for k, v in fam.build().state_dict().items()}  # "trained"
        (ckpt / m).mkdir(parents=True)
        save_file(state, str(ckpt / m / "full.safetensors"))
        files[f"{m}/full.safetensors"] = file_digest(ckpt / m / "full.safetensors")
        trained[m] = state
    (ckpt / "meta.json").write_text(json.dumps({"step": 3, "config": cfg.model_dump(mode="json")}))
    files["meta.json"] = file_digest(ckpt / "meta.json")
    manifest = {"format": CKPT_FORMAT, "step": 3, "layout": layout_of(cfg), "files": files}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return ckpt, trained


def test_export_manifest_rebuilds_each_module(toy_registry, tmp_path):
    ckpt, trained = _fake_checkpoint(tmp_path, toy_registry)
    out = tmp_path / "export"
    dirs = export_checkpoint(ckpt, out, toy_registry)
    assert sorted(p.name for p in dirs) == ["llm", "vision"]

    manifest = read_manifest(out)
    assert manifest["step"] == 3
    assert manifest["modules"]["vision"] == {
        "family": "toy",
        "role": "encoder",
        "path": "vision",
        "options": {"note": "kept"},
        "source": str(tmp_path / "models" / "toy_encoder"),
        "modality": "image",
    }
    assert manifest["modules"]["llm"]["role"] == "llm" and manifest["modules"]["llm"]["path"] == "llm"
    # the manifest's model section is a valid config model section as it stands
    Config.model_validate({"model": model_section(out)})

    families = load_exported(out, toy_registry)
    assert families["vision"].options == {"note": "kept"}
    for m, fam in families.items():
        assert_exact(fam.build().state_dict(), trained[m], f"exported {m} ")


def test_single_source_export_is_one_dir_with_its_manifest(toy_registry, tmp_path):
    ckpt, _ = _fake_checkpoint(tmp_path, toy_registry)
    meta = json.loads((ckpt / "meta.json").read_text())
    # both modules from one (whole-model) dir: exported as one HF dir, the manifest's path is "."
    meta["config"]["model"]["llm"]["path"] = meta["config"]["model"]["vision"]["path"]
    meta["config"]["model"]["llm"]["family"] = "toy"
    (ckpt / "meta.json").write_text(json.dumps(meta))
    m = json.loads((ckpt / "manifest.json").read_text())
    m["files"]["meta.json"] = file_digest(ckpt / "meta.json")
    (ckpt / "manifest.json").write_text(json.dumps(m))
    out = tmp_path / "whole"
    assert export_checkpoint(ckpt, out, toy_registry) == [out]
    assert {e["path"] for e in read_manifest(out)["modules"].values()} == {"."}


def test_not_an_export_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=MANIFEST):
        read_manifest(tmp_path)
