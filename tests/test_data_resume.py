"""Resume through the stream on a tiny Qwen2.5-VL: the resumed run logs the uninterrupted
run's losses, with a skipped corrupt image before the checkpoint, and never preprocesses a
sample from before the checkpointed stream position."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import ray

from disagg.config.validate import validate
from disagg.plugins import get_registry

pytest.importorskip("disagg_vision_sp")
if ("encoder", "qwen2_5_vl") not in get_registry().families:
    pytest.skip("qwen2_5_vl families not installed", allow_module_level=True)

from e2e_run import DDP, e2e_config  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # for Recorder


class Recorder:
    """``on_preprocess`` hook: stream positions data workers preprocess, appended to a file."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __call__(self, pos: int) -> None:
        with open(self.path, "a") as f:
            f.write(f"{pos}\n")


def losses(run: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines}


def test_resume_mid_stream_equals_uninterrupted(ray_local, tmp_path):
    from disagg.cli.make_tiny import make_tiny
    from disagg.data import build_data_source
    from disagg.data.synthetic import write_large
    from disagg.runtime.plan import families_for
    from disagg.runtime.run import run_training

    tiny = make_tiny(tmp_path / "tiny", ["qwen2_5_vl"], train_per_class=1, eval_per_class=1, image_size=28)
    root = Path(tiny["media_root"])
    data = write_large(tiny["data"]["train"], tmp_path / "d.jsonl", 40)
    rows = data.read_text().splitlines()
    (root / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 4)
    bad = json.loads(rows[2])
    bad["image"] = "corrupt.png"
    rows[2] = json.dumps(bad)
    data.write_text("\n".join(rows) + "\n")
    tiny["data"]["train"] = str(data)

    def config(out: Path, **checkpoint):
        families = {"vision": ("qwen2_5_vl", "qwen2_5_vl"), "llm": ("qwen2_5_vl", "qwen2_5_vl")}
        cfg = e2e_config(tiny, out, families, {"vision": DDP, "llm": DDP}, steps=4)
        cfg.data.on_error = "skip"
        cfg.data.shuffle = False  # the corrupt line 3 falls before the step-2 checkpoint
        cfg.checkpoint.every = 2
        for k, v in checkpoint.items():
            setattr(cfg.checkpoint, k, v)
        return cfg

    full = config(tmp_path / "full")
    run_training(validate(full, get_registry()), progress=False)
    ckpt = tmp_path / "full" / "checkpoints" / "step-2"
    state = json.loads((ckpt / "data.json").read_text())
    assert state["stats"]["skipped"] == 1 and state["position"] > 8  # the bad sample was before step 2

    resumed = config(tmp_path / "resumed", resume_from=str(ckpt), every=0)
    seen = tmp_path / "seen.txt"
    source = build_data_source(resumed, families_for(resumed, get_registry()), on_preprocess=Recorder(seen))
    run_training(validate(resumed, get_registry()), data_source=source, progress=False)
    want, got = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert got[step] == pytest.approx(want[step], rel=1e-6)
    positions = [int(x) for x in seen.read_text().split()]
    assert min(positions) == state["position"], "nothing before the checkpoint was preprocessed"
    final = json.loads((tmp_path / "resumed" / "checkpoints" / "step-4" / "data.json").read_text())
    assert final == json.loads((tmp_path / "full" / "checkpoints" / "step-4" / "data.json").read_text())
