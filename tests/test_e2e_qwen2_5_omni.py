"""Qwen2.5-Omni's thinker as three modules from ONE dir (issue 40): the vision tower
(``qwen2_5_omni``) under ``ulysses`` 2, the audio tower (``qwen2_5_omni_audio``)
under ``ddp`` with 2 replicas, the language model (``qwen2_5_omni``) under
``megatron_tp`` 2, all three ``path``s the same ``disagg make-tiny --families
qwen2_5_omni`` dir (the published layout: ``thinker.*`` tensors). Every step's loss
and gradient norm and every parameter after every step equal the single-process
``Qwen2_5OmniThinkerForConditionalGeneration`` fed what its processor gives it
(``pixel_values``/``image_grid_thw``, ``input_features``/``feature_attention_mask``)
on batches mixing text-only, one-image, two-image, audio, two-clip and
image+audio samples, with uneven audio replicas (one or three clips in a batch).
``disagg export`` then writes one dir the HF thinker class loads with the trained weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_audio")

from mixed_data import mixed_config  # noqa: E402

STEPS = 3
CLIPS = Path(__file__).parents[1] / "packages" / "audio" / "tests" / "data"
MODULES = {"vision": "qwen2_5_omni", "audio": "qwen2_5_omni_audio", "llm": "qwen2_5_omni"}
#: the reference thinker's submodule for each module's parameters
PREFIXES = {"vision": "model.visual.", "audio": "model.audio_tower.", "llm": ""}


def _write_data(root: Path) -> Path:
    """12 rows in file order, batches of 4 (2 microbatches of 2)."""
    import random

    from disagg.data.demo_data import draw_shape

    rng = random.Random(0)
    (root / "media").mkdir(parents=True)
    draw_shape("red", "square", 56, rng).resize((56, 28)).save(root / "media" / "wide.png")
    draw_shape("blue", "circle", 28, rng).save(root / "media" / "small.png")
    for clip in ("hello_44k.flac", "fox_16k.wav", "three_22k.ogg"):
        shutil.copy(CLIPS / clip, root / "media" / clip)

    def row(images: list[str], audios: list[str], answer: str) -> dict:
        prompt = "<image>" * len(images) + "<audio>" * len(audios) + "\nWhat is there?"
        item: dict = {"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]}
        if images:
            item["image"] = [f"media/{i}" for i in images]
        if audios:
            item["audio"] = [f"media/{a}" for a in audios]
        return item

    rows = [
        # step 1: one clip (one audio replica idles), two images, text only, image + audio
        row(["wide.png"], [], "A red square."),
        row([], ["hello_44k.flac"], "hello world"),
        row(["small.png", "wide.png"], [], "A circle and a square."),
        row([], [], "Nothing."),
        # step 2: three samples with audio (2 + 1 over the replicas), two clips in one sample
        row([], ["three_22k.ogg", "fox_16k.wav"], "one two three, a fox"),
        row(["small.png"], ["fox_16k.wav"], "A blue circle and a fox."),
        row([], [], "Still nothing."),
        row([], ["hello_44k.flac"], "hello"),
        # step 3: no audio at all (the audio group idles; weight decay must leave it alone)
        row([], [], "Quiet."),
        row(["wide.png"], [], "A square."),
        row(["small.png"], [], "A blue circle."),
        row([], [], "Nothing at all."),
    ]
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    from disagg.cli.main import main

    out = tmp_path_factory.mktemp("qwen2_5_omni")
    assert main(["make-tiny", str(out / "tiny"), "--families", "qwen2_5_omni", "--no-data"]) == 0
    manifest = json.loads((out / "tiny" / "manifest.json").read_text())
    return {"path": manifest["models"]["qwen2_5_omni"], "train": _write_data(out / "data"), "root": out}


def _config(omni: dict, out: Path, parallel: dict):  # noqa: ANN202
    model = {m: {"family": f, "path": omni["path"]} for m, f in MODULES.items()}
    data = {"train": str(omni["train"]), "media_root": str(omni["root"] / "data")}
    return mixed_config(model, parallel, data, out, STEPS, checkpoint_every=1)


def _thinker_kwargs(s: dict) -> dict:
    """The thinker's keyword arguments for one sample, as Qwen2.5-Omni's processor hands them over."""
    llm = s["llm"]
    kw = {"input_ids": llm["input_ids"][None], "labels": llm["labels"][None]}
    kw["attention_mask"] = torch.ones_like(kw["input_ids"])
    if "vision" in s:
        kw.update(pixel_values=s["vision"]["pixel_values"], image_grid_thw=s["vision"]["image_grid_thw"])
    if "audio" in s:
        a = s["audio"]
        kw.update(input_features=a["input_features"], feature_attention_mask=a["feature_attention_mask"])
    return kw


def test_thinker_as_three_modules_from_one_dir(ray_local, omni, tmp_path):
    from hf_reference import assert_run_matches, batches_of, train_reference
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    from disagg.config.validate import validate
    from disagg.plugins import get_registry
    from disagg.runtime.actor.state import read_module_state
    from disagg.runtime.run import run_training

    parallel = {
        "vision": {"strategy": "ulysses", "degree": 2},
        "audio": {"strategy": "ddp", "replicas": 2},
        "llm": {"strategy": "megatron_tp", "degree": 2},
    }
    cfg = _config(omni, tmp_path / "run", parallel)
    run_training(validate(cfg, get_registry()), progress=False)

    batches = batches_of(cfg, STEPS)
    kinds = [{("vision" in s, "audio" in s) for s in b} for b in batches]
    assert kinds[0] == {(True, False), (False, True), (False, False)} and (True, True) in kinds[1]
    assert any(s["vision"]["image_grid_thw"].shape[0] == 2 for s in batches[0] if "vision" in s)
    assert any(s["audio"]["feature_attention_mask"].shape[0] == 2 for s in batches[1] if "audio" in s)
    thinker = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(omni["path"], dtype=torch.float32)
    reference = train_reference(thinker, batches, _thinker_kwargs, cfg.train)

    def rename(d: dict) -> dict:
        out = {}
        for k, v in d.items():
            m = next(m for m, p in PREFIXES.items() if k.startswith(p))  # "" (llm) last
            out[f"{m}/{k[len(PREFIXES[m]) :]}"] = v
        return out

    reference.states = [rename(x) for x in reference.states]
    reference.grads = [rename(x) for x in reference.grads]

    def state_after(step: int) -> dict:
        ckpt = tmp_path / "run" / "checkpoints" / f"step-{step}"
        return {f"{m}/{k}": v for m in MODULES for k, v in read_module_state(ckpt, m)[0].items()}

    assert_run_matches(tmp_path / "run", reference, state_after, cfg.train)
    _export_loads_in_the_thinker(tmp_path, state_after(STEPS))


def _export_loads_in_the_thinker(tmp: Path, trained: dict) -> None:
    """``disagg export``: one dir (one source) that the HF thinker class loads, holding
    every trained tensor of the three modules under the thinker's names."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    from disagg.cli.main import main

    out = tmp / "export"
    assert main(["export", str(tmp / "run" / "checkpoints" / f"step-{STEPS}"), str(out)]) == 0
    thinker = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    params = {}
    for name, p in thinker.named_parameters():
        m = next(m for m, pre in PREFIXES.items() if name.startswith(pre))
        params[f"{m}/{name[len(PREFIXES[m]) :]}"] = p.detach()
    assert set(params) == set(trained)
    for name, value in trained.items():
        assert torch.equal(params[name], value), f"{name}: the exported thinker holds another tensor"
