"""InternVL (issue 40) end to end against the single-process
``InternVLForConditionalGeneration``, at every step: the InternViT tower and projector
(``internvl`` vision family) under ``ulysses`` 2, the Qwen2 decoder (``internvl`` LLM
family) under ``ddp`` over 2 replicas, on the mixed dataset (images of three sizes that
the processor tiles into 1, 3 and 5 tiles, a two-image sample, text-only samples and a
text-only global batch; two microbatches whose samples split unevenly between the
decoder's replicas; weight decay on). Loss and gradient norm of every step, and every
parameter after the last step read back from ``disagg export`` through
``from_pretrained``.

A tile is 17 tokens in the tower (CLS + 4 x 4 patches), so the two Ulysses shards meet
inside a tile, at a band of two patch rows that the pixel shuffle merges (checked
below: the test would otherwise only cover cuts at tile starts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

from hf_reference import (  # noqa: E402
    assert_run_matches_reference,
    batches_of,
    pixel_values_kwargs,
    train_reference,
)
from mixed_data import make_mixed_tiny, mixed_config  # noqa: E402

from disagg.config.validate import validate  # noqa: E402
from disagg.plugins import get_registry  # noqa: E402

STEPS = 3
#: (tower, decoder): the tower under ulysses with the decoder's replicas reading uneven
#: samples; both under megatron_tp (the tower's layer map, the decoder with sequence parallelism)
LAYOUTS = {
    "ulysses2+ddp2": ({"strategy": "ulysses", "degree": 2}, {"strategy": "ddp", "replicas": 2}),
    "tp2+tp2sp": (
        {"strategy": "megatron_tp", "degree": 2},
        {"strategy": "megatron_tp", "degree": 2, "sequence_parallel": True},
    ),
}


def _config(tiny: dict, out: Path, vision: dict, llm: dict):  # noqa: ANN202
    path = tiny["models"]["internvl"]
    model = {m: {"family": "internvl", "path": path} for m in ("vision", "llm")}
    return mixed_config(model, {"vision": vision, "llm": llm}, tiny, out, STEPS)


@pytest.fixture(scope="module")
def internvl(ray_local, tmp_path_factory):
    """The tiny dir, the batches and the HF reference run."""
    from transformers import InternVLForConditionalGeneration

    tiny = make_mixed_tiny(tmp_path_factory.mktemp("tiny"), "internvl")
    ddp = {"strategy": "ddp"}
    cfg = _config(tiny, tmp_path_factory.mktemp("ref"), ddp, ddp)
    batches = batches_of(cfg, STEPS)
    assert [all("vision" not in s for s in b) for b in batches] == [False, True, False]
    tiles = sorted({int(n) for b in batches for s in b if "vision" in s for n in s["vision"]["num_patches"]})
    assert tiles == [1, 3, 5], tiles  # 28x28, 56x28 (+ thumbnail), 56x56 (+ thumbnail)
    model = InternVLForConditionalGeneration.from_pretrained(tiny["models"]["internvl"], dtype=torch.float32)
    return tiny, batches, train_reference(model, batches, pixel_values_kwargs, cfg.train)


def test_ulysses_shards_meet_inside_a_tile(internvl):
    """The step-1 microbatches' shard bounds under degree 2 fall inside a tile (on a band
    boundary), so the shuffle of a tile split over two ranks is what the e2e run checks."""
    from disagg_vision_sp.families.internvl import InternVLVision
    from disagg_vision_sp.ulysses.layout import plan_bounds

    tiny, batches, _ = internvl
    fam = InternVLVision(tiny["models"]["internvl"])
    inside = []
    for mb in (batches[0][:2], batches[0][2:]):
        layout = fam.ulysses_layout([s["vision"] for s in mb if "vision" in s])
        mid = plan_bounds(layout.cuts, layout.n_tokens, 2)[1]
        inside.append(mid % layout.extra["per_tile"])
    assert any(inside), inside


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_internvl_equals_hf_model_every_step(ray_local, internvl, tmp_path, layout):
    from transformers import InternVLForConditionalGeneration

    from disagg.runtime.run import run_training

    tiny, _, want = internvl
    run = tmp_path / "run"
    cfg = _config(tiny, run, *LAYOUTS[layout])
    run_training(validate(cfg, get_registry()), progress=False)
    assert len(want.losses) == STEPS
    assert_run_matches_reference(run, want, cfg.train, InternVLForConditionalGeneration, f"internvl {layout}")


def test_internvl_dir_refuses_what_the_family_cannot_read(internvl, tmp_path):
    """A dir whose features come from another layer is refused with the key, file and allowed value."""
    import json
    import shutil

    from disagg_vision_sp.families.internvl import InternVLVision

    src = Path(internvl[0]["models"]["internvl"])
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["vision_feature_layer"] = -2
    (bad / "config.json").write_text(json.dumps(cfg))
    (problem,) = InternVLVision(bad).check("ulysses", 2, 1)
    assert "vision_feature_layer=-2" in problem and "config.json" in problem and "-1" in problem, problem
