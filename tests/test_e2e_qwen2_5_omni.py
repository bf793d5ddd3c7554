"""Qwen2.5-Omni's thinker as three modules from ONE dir (issue 40): the vision tower
(``qwen2_5_omni``) under ``ulysses`` 2, the audio tower (``qwen2_5_omni_audio``)
under ``ddp`` with 2 replicas, the language model (``qwen2_5_omni``) under
``megatron_tp`` 2, all three ``path``s the same ``disagg make-tiny --families
qwen2_5_omni`` dir (the published layout: ``thinker.*`` tensors). Every step's loss
and gradient norm and every parameter after every step equal the single-process
``Qwen2_5OmniThinkerForConditionalGeneration`` fed what its processor gives it
(``pixel_values``/``image_grid_thw``, ``input_features``/``feature_attention_mask``)
on batches mixing text-only, one-image, two-image, audio, two-clip and
image+audio samples, with uneven audio replicas (one or three clips in a batch), and video:
step 3 has an image-then-video row, step 4 mixes a video row, an image row, an audio row and a
text row (real encoded files, ``pixel_values_videos``/``video_grid_thw``/``video_second_per_grid``
handed to the thinker, whose MRoPE time axis is ``video_second_per_grid *
position_id_per_seconds``). The HF model cannot see a wrong prompt or seconds per grid (it
reads ours), so those are checked against transformers' own ``Qwen2VLVideoProcessor``
(``sample_frames``, ``smart_resize``) and ``Qwen2_5OmniProcessor._process_videos`` /
``replace_video_token``. ``disagg export`` then writes one dir the HF thinker class loads with
the trained weights.
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

STEPS = 4
#: as the Qwen2.5-VL video test: 64x48 frames -> 6x8 patches (tiny tower: patch 4, merge 2)
VIDEO = {"video_fps": 2.0, "video_max_frames": 8, "video_min_pixels": 64, "video_max_pixels": 1024}
CLIPS = Path(__file__).parents[1] / "packages" / "audio" / "tests" / "data"
MODULES = {"vision": "qwen2_5_omni", "audio": "qwen2_5_omni_audio", "llm": "qwen2_5_omni"}
#: the reference thinker's submodule for each module's parameters
PREFIXES = {"vision": "model.visual.", "audio": "model.audio_tower.", "llm": ""}


def _write_data(root: Path) -> Path:
    """16 rows in file order, batches of 4 (2 microbatches of 2)."""
    import random

    from video_data import write_video

    from disagg.data.demo_data import draw_shape

    rng = random.Random(0)
    (root / "media").mkdir(parents=True)
    draw_shape("red", "square", 56, rng).resize((56, 28)).save(root / "media" / "wide.png")
    draw_shape("blue", "circle", 28, rng).save(root / "media" / "small.png")
    for clip in ("hello_44k.flac", "fox_16k.wav", "three_22k.ogg"):
        shutil.copy(CLIPS / clip, root / "media" / clip)
    # 10 frames at 4 fps (4 sampled: 1.6 fps sampled, 2 asked), 12 at 3 fps (8 sampled)
    write_video(root / "media" / "clip.mp4", n_frames=10, rate=4)
    write_video(root / "media" / "long.mp4", n_frames=12, rate=3, size=(80, 48))

    def row(images: list[str], audios: list[str], answer: str, videos: tuple[str, ...] = ()) -> dict:
        prompt = "<image>" * len(images) + "<video>" * len(videos) + "<audio>" * len(audios)
        prompt += "\nWhat is there?"
        item: dict = {"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]}
        if images:
            item["image"] = [f"media/{i}" for i in images]
        if audios:
            item["audio"] = [f"media/{a}" for a in audios]
        if videos:
            item["video"] = [f"media/{v}" for v in videos]
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
        row(["small.png"], [], "A circle, then colors.", videos=("long.mp4",)),
        # step 4: video, image, audio, text
        row([], [], "Colors change.", videos=("clip.mp4",)),
        row(["wide.png"], [], "A red square."),
        row([], ["fox_16k.wav"], "a fox"),
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
    cfg = mixed_config(model, parallel, data, out, STEPS, checkpoint_every=1)
    cfg.data = cfg.data.model_copy(update=VIDEO)
    return cfg


def _thinker_kwargs(s: dict) -> dict:
    """The thinker's keyword arguments for one sample, as Qwen2.5-Omni's processor hands them over."""
    llm = s["llm"]
    kw = {"input_ids": llm["input_ids"][None], "labels": llm["labels"][None]}
    kw["attention_mask"] = torch.ones_like(kw["input_ids"])
    for k in (
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "video_second_per_grid",
    ):
        if k in s.get("vision", {}):
            kw[k] = s["vision"][k]
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
    _check_video_inputs(omni, batches, cfg)
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


def _transformers_video(path: Path, vision_config, fps: float) -> tuple[list[int], float, str]:
    """The grid, seconds per temporal patch and placeholder text transformers' Qwen2.5-Omni
    processing makes of ``path``: its video processor's ``sample_frames``/``smart_resize``
    (run from its source: the module needs torchvision) on the frame count and rate PyAV reads,
    then ``Qwen2_5OmniProcessor._process_videos`` itself for ``video_second_per_grid`` and the
    ``<|VIDEO|>`` run."""
    import types

    import av
    from test_video_sampling import REF
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor
    from transformers.video_utils import VideoMetadata

    with av.open(str(path)) as c:
        s = c.streams.video[0]
        total, rate, h, w = s.frames, float(s.average_rate), s.height, s.width
    n = len(
        REF.sample(
            VideoMetadata(total_num_frames=total, fps=rate), fps=fps, max_frames=VIDEO["video_max_frames"]
        )
    )
    v = vision_config
    rh, rw = REF.smart_resize(
        h, w, factor=v.patch_size * v.spatial_merge_size,
        min_pixels=VIDEO["video_min_pixels"], max_pixels=VIDEO["video_max_pixels"],
    )  # fmt: skip
    grid = [n // v.temporal_patch_size, rh // v.patch_size, rw // v.patch_size]

    def video_processor(videos: list, **kw: object) -> dict:  # the grid from its functions above
        return {"video_grid_thw": torch.tensor([grid])}

    video_processor.temporal_patch_size = v.temporal_patch_size
    video_processor.merge_size = v.spatial_merge_size
    proc = types.SimpleNamespace(video_processor=video_processor, video_token="<|VIDEO|>")
    proc.replace_video_token = lambda *a, **kw: Qwen2_5OmniProcessor.replace_video_token(proc, *a, **kw)
    out, (text,) = Qwen2_5OmniProcessor._process_videos(
        proc, [path], videos_kwargs={"fps": fps}, load_audio_from_video=False, video_to_audio_indices=[None]
    )
    (seconds,) = out["video_second_per_grid"]
    return grid, float(seconds), text


def _check_video_inputs(omni: dict, batches: list, cfg) -> None:  # noqa: ANN001
    """Each video row's grid, seconds per grid and prompt are transformers' for the same file."""
    from transformers import AutoConfig, AutoTokenizer

    vision_config = AutoConfig.from_pretrained(omni["path"]).thinker_config.vision_config
    tok = AutoTokenizer.from_pretrained(omni["path"])
    media = omni["root"] / "data" / "media"
    rows = [s for b in batches for s in b if "video_grid_thw" in s.get("vision", {})]
    assert len(rows) == 2 and "pixel_values" in rows[0]["vision"]  # long.mp4 after an image; clip.mp4
    for s, name in zip(rows, ("long.mp4", "clip.mp4")):
        grid, seconds, text = _transformers_video(media / name, vision_config, cfg.data.video_fps)
        assert s["vision"]["video_grid_thw"].tolist() == [grid], (name, s["vision"]["video_grid_thw"], grid)
        assert s["vision"]["video_second_per_grid"].tolist() == [seconds], (name, seconds)
        prompt = tok.decode(s["llm"]["input_ids"].tolist(), skip_special_tokens=False)
        assert f"<|vision_bos|>{text}<|vision_eos|>" in prompt, (name, prompt)
    # clip.mp4: 4 of 10 frames, 2 x 6 x 8 patches; 1 s per grid from the asked 2 fps (the sampled
    # 1.6 fps, Qwen2.5-VL's rule, would give 1.25 s and other positions)
    assert rows[1]["vision"]["video_grid_thw"].tolist() == [[2, 6, 8]]
    assert rows[1]["vision"]["video_second_per_grid"].tolist() == [1.0]


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


@pytest.mark.parametrize("module", ["vision", "llm"])
def test_audio_in_video_is_refused_by_name(omni, tmp_path, module):
    """``use_audio_in_video`` (the video's own audio track interleaved with its frames) is
    refused before any actor starts, naming the option and what to do instead."""
    from disagg.config.validate import ConfigError, validate
    from disagg.plugins import get_registry

    cfg = _config(omni, tmp_path / "run", {m: {"strategy": "ddp"} for m in MODULES})
    spec = getattr(cfg.model, module)
    spec.options = {**spec.options, "use_audio_in_video": True}
    with pytest.raises(ConfigError) as err:
        validate(cfg, get_registry())
    msg = str(err.value)
    assert f"model.{module}.options.use_audio_in_video" in msg and "<audio>" in msg, msg
