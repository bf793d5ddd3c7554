"""``disagg export`` streams: HF sharded safetensors written tensor by tensor.

A toy LM of ~74 MB (fp32) is exported with 8 MB shards; the export's resident
memory grows by well under the model's size (it holds about one shard; the
export before streaming loaded the source dir and the checkpoint whole: about
twice the model), and the shards hold exactly the checkpoint's tensors under
an index that names every one. The checkpoint is written by hand in the full
form the actors write (no Ray): what is under test is export, not training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from disagg.config.schema import Config
from disagg.runtime.actor.state import file_digest
from disagg.runtime.checkpoint import FORMAT as CKPT_FORMAT
from disagg.runtime.checkpoint import layout_of
from disagg.runtime.export import export_checkpoint, read_manifest
from disagg.runtime.hf_shards import INDEX, parse_max_shard_size
from disagg.testing import toy
from disagg.testing.tolerance import assert_exact

HERE = Path(__file__).parent


@pytest.fixture
def toy_registry(disagg_registry):
    from disagg.plugins import register_plugin

    return register_plugin(toy, name="disagg.testing.toy")


def _big_checkpoint(root: Path, hidden: int = 512, layers: int = 6, vocab: int = 4096) -> tuple[Path, int]:
    """A toy LM dir (its weights zeros: export never reads them, the checkpoint
    replaces every tensor) and a complete ``step-1`` checkpoint of random
    weights; returns the checkpoint and the model's fp32 bytes."""
    cfg = toy.ToyLMConfig(hidden=hidden, layers=layers, vocab_size=vocab, heads=8)
    lm = root / "toy_lm"
    cfg.save_pretrained(lm)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in toy.ToyLM(cfg).state_dict().items()}
    save_file({k: torch.zeros(s) for k, s in shapes.items()}, str(lm / "model.safetensors"))
    config = Config.model_validate(
        {"model": {"llm": {"family": "toy", "path": str(lm)}}, "output_dir": str(root / "run")}
    )
    ckpt = root / "run" / "checkpoints" / "step-1"
    (ckpt / "llm").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    save_file(
        {k: torch.randn(s, generator=g) for k, s in shapes.items()}, str(ckpt / "llm" / "full.safetensors")
    )
    files = {"llm/full.safetensors": file_digest(ckpt / "llm" / "full.safetensors")}
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "config": config.model_dump(mode="json")}))
    files["meta.json"] = file_digest(ckpt / "meta.json")
    manifest = {"format": CKPT_FORMAT, "step": 1, "layout": layout_of(config), "files": files}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return ckpt, sum(s.numel() * 4 for s in shapes.values())


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith(field + ":"))


def _export_peak(ckpt: Path, out: Path, registry, size: str) -> tuple[int, int]:
    """(resident bytes before, high-water mark after) one export. In this
    process when the kernel lets it reset the high-water mark (clear_refs 5),
    else in a fresh one (``export_peak_memory.py``)."""
    import gc

    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        run = subprocess.run(
            [sys.executable, str(HERE / "export_peak_memory.py"), str(ckpt), str(out), size],
            check=True,
            capture_output=True,
            text=True,
        )
        got = json.loads(run.stdout.splitlines()[-1])
        return got["base"], got["peak"]
    base = _status("VmRSS")
    export_checkpoint(ckpt, out, registry, max_shard_size=size)
    return base, _status("VmHWM")


def test_export_streams_shards_below_the_model_size(toy_registry, tmp_path):
    ckpt, model_bytes = _big_checkpoint(tmp_path / "m")
    out = tmp_path / "export"
    base, peak = _export_peak(ckpt, out, toy_registry, "8MB")
    grown = peak - base
    print(f"model {model_bytes / 2**20:.0f} MiB, export grew resident memory by {grown / 2**20:.1f} MiB")
    # about one 8 MB shard (plus the mapped pages it was read from); loading the model would be >= 1x
    assert grown < 0.5 * model_bytes, (grown, model_bytes)

    index = json.loads((out / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n >= model_bytes // 8_000_000 - 1, shards
    assert shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards  # no stray model.safetensors
    assert index["metadata"]["total_size"] == model_bytes
    trained = load_file(str(ckpt / "llm" / "full.safetensors"))
    got = {}
    for s in shards:
        with safe_open(str(out / s), framework="pt") as fh:
            assert {k for k, v in index["weight_map"].items() if v == s} == set(fh.keys())
            # under the limit (+ header), unless one tensor alone is larger (as save_pretrained)
            assert (out / s).stat().st_size <= 8_000_000 + 2**16 or len(fh.keys()) == 1, s
        got.update(load_file(str(out / s)))
    # bit-exact, as assert_exact checks; torch.equal because the policy's diagnostics on 64 MiB cost seconds
    assert got.keys() == trained.keys()
    assert [k for k in trained if not torch.equal(got[k], trained[k])] == []
    assert read_manifest(out)["dtype"] == "fp32"


def test_export_in_bf16_then_refit_into_one_file(toy_registry, tmp_path):
    """``dtype=bf16`` writes bf16 tensors (the fp32 ones cast) and says so in
    config.json; a second export into the same dir as one file leaves no shard
    of the first behind."""
    ckpt, _ = _big_checkpoint(tmp_path / "m", hidden=64, layers=2, vocab=256)
    out = tmp_path / "export"
    export_checkpoint(ckpt, out, toy_registry, max_shard_size="20KB", dtype="bf16")
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 2
    index = json.loads((out / INDEX).read_text())
    got = {}
    for s in set(index["weight_map"].values()):
        got.update(load_file(str(out / s)))
    trained = load_file(str(ckpt / "llm" / "full.safetensors"))
    assert_exact(got, {k: v.to(torch.bfloat16) for k, v in trained.items()}, "bf16 export ")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"

    export_checkpoint(ckpt, out, toy_registry)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / INDEX).exists()
    assert_exact(load_file(str(out / "model.safetensors")), trained, "fp32 re-export ")
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_exported_files_are_readable_by_others(toy_registry, tmp_path):
    """Every exported file gets the umask's mode (0644 under 022), not safetensors' 0600."""
    ckpt, _ = _big_checkpoint(tmp_path / "m", hidden=64, layers=2, vocab=256)
    old = os.umask(0o022)
    try:
        export_checkpoint(ckpt, tmp_path / "export", toy_registry, max_shard_size="20KB")
    finally:
        os.umask(old)
    files = [f for f in (tmp_path / "export").rglob("*") if f.is_file()]
    assert any(f.suffix == ".safetensors" for f in files)
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: "0o644" for f in files}


def test_shard_sizes_parse_like_save_pretrained():
    assert parse_max_shard_size("5GB") == 5 * 10**9
    assert parse_max_shard_size("100KB") == 100_000
    assert parse_max_shard_size("1234") == 1234
    for bad in ("5 parsecs", "0KB", "-1"):
        with pytest.raises(ValueError):
            parse_max_shard_size(bad)


def test_cli_names_a_bad_shard_size(tmp_path, capsys):
    from disagg.cli.main import main

    ckpt, _ = _big_checkpoint(tmp_path / "m", hidden=16, layers=1, vocab=64)
    assert main(["export", str(ckpt), str(tmp_path / "out"), "--max-shard-size", "lots"]) == 2
    err = capsys.readouterr().err
    assert "--max-shard-size" in err and "'lots'" in err, err
    assert not (tmp_path / "out").exists()


def test_a_family_that_computes_its_export_is_read_for_real(tmp_path):
    """Streaming relies on ``export_state`` being a name mapping; a family that
    computes tensors (fuses, splits, scales) still exports right, from its real state."""
    from disagg.runtime.export import _module_entries
    from disagg.runtime.hf_shards import TensorRef

    class Fusing(toy.ToyLMFamily):
        def export_state(self, state):
            return {"fused": torch.cat([state["a"], state["b"]]), "b": state["b"]}

    full = tmp_path / "full.safetensors"
    save_file({"a": torch.arange(3.0), "b": torch.ones(2)}, str(full))
    got = _module_entries(Fusing(tmp_path), full)
    assert not any(isinstance(v, TensorRef) for v in got.values())
    want = {"fused": torch.tensor([0.0, 1.0, 2.0, 1.0, 1.0]), "b": torch.ones(2)}
    assert_exact(got, want, "computed export ")
