"""Three modules from three HF dirs, end to end through ``run_training``: a
Qwen2.5-VL vision tower, a Whisper encoder (projector initialised, as the dir
has none) and a Qwen2 LLM. Batches mix image-only, audio-only, image+audio
and text-only samples; the per-step losses and gradient norms, and every
module's weights after each step, equal Hugging Face's own modules from the
same dirs in one process (:class:`HFOmni`: the Qwen2.5-VL ``visual`` tower,
the Whisper encoder as ``disagg_audio.testing`` runs HF's forward, the
``Qwen2ForCausalLM`` fed ``inputs_embeds`` with the rows scattered at the
placeholder tokens, as HF's VLMs do), one AdamW over all of them.

Layout of the issue: vision ``ulysses`` 2, audio ``zero`` stage 2 with 2
replicas, LLM ``megatron_tp`` 2 (all-``ddp`` gives the same; it is left out
to keep CI short).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from disagg.config.validate import validate

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_audio")

from mixed_data import mixed_config  # noqa: E402

from disagg.config.schema import Config  # noqa: E402
from disagg.plugins import get_registry  # noqa: E402

STEPS = 5
CLIPS = Path(__file__).parents[1] / "packages" / "audio" / "tests" / "data"


def _write_data(root: Path) -> Path:
    """12 samples in file order (shuffle off), batches of 4: the first two hold
    image-only, audio-only, image+audio and text-only samples, speech clips of
    different lengths (one longer than the tiny encoder's 1 s window); the
    third has no audio at all, so the audio group idles (and, with weight
    decay on, must leave its parameters alone, as the reference does)."""
    import random
    import shutil

    from disagg.data.demo_data import draw_shape

    rng = random.Random(0)
    (root / "media").mkdir(parents=True)
    draw_shape("red", "square", 56, rng).resize((56, 28)).save(root / "media" / "wide.png")
    draw_shape("blue", "circle", 28, rng).save(root / "media" / "small.png")
    for clip in ("hello_44k.flac", "fox_16k.wav", "three_22k.ogg"):
        shutil.copy(CLIPS / clip, root / "media" / clip)

    def row(image: str | None, audio: str | None, answer: str) -> dict:
        prompt = ("<image>" if image else "") + ("<audio>" if audio else "") + "\nWhat is there?"
        item = {"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]}
        if image:
            item["image"] = f"media/{image}"
        if audio:
            item["audio"] = f"media/{audio}"
        return item

    rows = [
        row("wide.png", None, "A red square."),
        row(None, "hello_44k.flac", "hello world"),
        row("small.png", "fox_16k.wav", "A blue circle and a fox."),
        row(None, None, "Nothing."),
        row(None, "three_22k.ogg", "one two three"),
        row("small.png", "hello_44k.flac", "A circle saying hello."),
        row(None, None, "Still nothing."),
        row("wide.png", None, "A square."),
        row("small.png", None, "A blue circle."),
        row(None, None, "Quiet."),
        row("wide.png", None, "A red square."),
        row(None, None, "Nothing at all."),
    ]
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from disagg_audio.families.whisper import WhisperAudioFamily
    from disagg_llm_tp.families.tiny import decoder_sizes, qwen_tokenizer, save_random
    from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision

    out = tmp_path_factory.mktemp("omni")
    vision = Qwen2_5_VLVision.make_tiny(out / "qwen2_5_vl")
    audio = WhisperAudioFamily.make_tiny(out / "whisper")
    tok = qwen_tokenizer(out / "qwen2")
    # 48 wide: the width the tiny Qwen2.5-VL merger projects to
    config = Qwen2Config(
        **decoder_sizes(len(tok), hidden_size=48),
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    llm = save_random(Qwen2ForCausalLM, config, out / "qwen2", 0)
    return {"vision": vision, "audio": audio, "llm": llm, "train": _write_data(out / "data"), "root": out}


def _config(omni: dict, out: Path, parallel: dict) -> Config:
    model = {
        "vision": {"family": "qwen2_5_vl", "path": str(omni["vision"])},
        "audio": {"family": "whisper", "path": str(omni["audio"]), "options": {"hidden_size": 48}},
        "llm": {"family": "qwen2", "path": str(omni["llm"])},
    }
    data = {"train": str(omni["train"]), "media_root": str(omni["root"] / "data")}
    return mixed_config(model, parallel, data, out, STEPS, checkpoint_every=1, microbatches=1)


class HFOmni(torch.nn.Module):
    """The HF modules of the three dirs and their composition, sample by sample."""

    def __init__(self, omni: dict, audio_family) -> None:  # noqa: ANN001
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2ForCausalLM

        from disagg_audio.testing import HFAudioReference

        super().__init__()
        self.visual = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            omni["vision"], dtype=torch.float32
        ).model.visual
        self.audio = HFAudioReference(audio_family)
        self.llm = Qwen2ForCausalLM.from_pretrained(omni["llm"], dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(omni["llm"])
        self.image_id, self.audio_id = tok.convert_tokens_to_ids(["<|image_pad|>", "<|AUDIO|>"])

    def forward(self, input_ids, labels, pixel_values=None, image_grid_thw=None, audio=None):  # noqa: ANN001, ANN201
        x = self.llm.get_input_embeddings()(input_ids)
        if pixel_values is not None:
            rows = self.visual(pixel_values, grid_thw=image_grid_thw).pooler_output
            x = x.masked_scatter((input_ids == self.image_id)[..., None], rows)
        if audio is not None:
            x = x.masked_scatter((input_ids == self.audio_id)[..., None], self.audio(audio))
        return self.llm(inputs_embeds=x, labels=labels)


@pytest.fixture(scope="module")
def reference(ray_local, omni, tmp_path_factory):
    """HF's modules trained on the run's global batches (read from the object store),
    each sample's clip decoded from its file for HF's feature extractor."""
    import ray
    from hf_reference import train_reference

    from disagg.data import build_data_source
    from disagg.runtime.plan import families_for

    cfg = _config(omni, tmp_path_factory.mktemp("ref"), {})
    families = families_for(cfg, get_registry())
    rows = [json.loads(x) for x in Path(omni["train"]).read_text().splitlines()]
    batches, kinds = [], []
    for _, batch in zip(range(STEPS), build_data_source(cfg, families).batches(0)):
        samples = []
        for s in batch:
            x = {m: ray.get(r) for m, r in s.inputs.items()}
            if "audio" in x:
                clip = str(omni["root"] / "data" / rows[s.index]["audio"])
                # the sample is that row: its clip preprocesses to the run's audio inputs
                ours = families["audio"].preprocess([clip])
                assert all(torch.equal(ours[k], x["audio"][k]) for k in ours), s.index
                x["audio_items"] = [clip]
            samples.append(x)
        batches.append(samples)
        kinds.append({(("vision" in s), ("audio" in s)) for s in samples})
    mixed = {(True, False), (False, True), (True, True), (False, False)}
    assert kinds[:3] == [mixed, mixed, {(True, False), (False, False)}]

    def kwargs(s: dict) -> dict:
        kw = {"input_ids": s["llm"]["input_ids"][None], "labels": s["llm"]["labels"][None]}
        if "vision" in s:
            kw.update(pixel_values=s["vision"]["pixel_values"], image_grid_thw=s["vision"]["image_grid_thw"])
        if "audio" in s:
            kw["audio"] = s["audio_items"]
        return kw

    model = HFOmni(omni, families["audio"])
    run = train_reference(model, batches, kwargs, cfg.train)
    # one namespace per module, as the run's checkpoints name them
    prefixes = {"vision": "visual.", "audio": "audio.", "llm": "llm."}

    def rename(d: dict) -> dict:
        return {f"{m}/{k[len(p) :]}": v for m, p in prefixes.items() for k, v in d.items() if k.startswith(p)}

    run.states = [rename(x) for x in run.states]
    run.grads = [rename(x) for x in run.grads]
    return run


MODULES = ("vision", "audio", "llm")
LAYOUTS = {
    "ulysses2+zero2x2+tp2": (
        {"strategy": "ulysses", "degree": 2},
        {"strategy": "zero", "stage": 2, "replicas": 2},
        {"strategy": "megatron_tp", "degree": 2},
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_three_modules_match_single_process(ray_local, omni, reference, tmp_path, name):
    from disagg.runtime.run import run_training

    vision, audio, llm = LAYOUTS[name]
    if "zero" in (vision["strategy"], audio["strategy"], llm["strategy"]):
        pytest.importorskip("disagg_zero")
    cfg = _config(omni, tmp_path / "run", {"vision": vision, "audio": audio, "llm": llm})
    run_training(validate(cfg, get_registry()), progress=False)
    from hf_reference import assert_run_matches

    from disagg.runtime.actor.state import read_module_state

    def state_after(step: int) -> dict:
        ckpt = tmp_path / "run" / "checkpoints" / f"step-{step}"
        return {f"{m}/{k}": v for m in MODULES for k, v in read_module_state(ckpt, m)[0].items()}

    assert_run_matches(tmp_path / "run", reference, state_after, cfg.train)
    ckpt = tmp_path / "run" / "checkpoints" / f"step-{STEPS}"
    last = state_after(STEPS)
    trained = {m: {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith(m + "/")} for m in MODULES}
    _export_reassembles(ckpt, tmp_path / "export", trained, omni)


def _export_reassembles(ckpt: Path, out: Path, trained: dict, omni: dict) -> None:
    """``disagg export`` of the three-dir model: one HF dir per source plus the
    manifest; each module rebuilt from it through its family (``from_pretrained``)
    holds exactly the trained parameters, and the audio encoder (its projector
    width comes from the manifest's options) gives the trained module's output."""
    import torch

    from disagg.cli.main import main
    from disagg.data.media import load_audio
    from disagg.runtime.export import load_exported, read_manifest

    assert main(["export", str(ckpt), str(out)]) == 0
    modules = read_manifest(out)["modules"]
    assert {m: (e["family"], e["role"], e["path"]) for m, e in modules.items()} == {
        "vision": ("qwen2_5_vl", "encoder", "vision"),
        "audio": ("whisper", "encoder", "audio"),
        "llm": ("qwen2", "llm", "llm"),
    }
    assert modules["audio"]["options"] == {"hidden_size": 48} and modules["audio"]["modality"] == "audio"
    families = load_exported(out, get_registry())
    built = {}
    for m, fam in families.items():
        built[m] = fam.build()
        params = dict(built[m].named_parameters())
        assert params and set(params) <= set(trained[m]), m
        for name, p in params.items():
            assert torch.equal(p.detach(), trained[m][name]), f"{m}: {name} differs from the trained tensor"
    # the same clip through the rebuilt encoder and through the trained weights in the source dir's module
    audio = families["audio"]
    inputs = audio.preprocess([load_audio(str(CLIPS / "fox_16k.wav"))])
    source = get_registry().family("encoder", "whisper")(omni["audio"], {"hidden_size": 48}).build()
    source.load_state_dict(trained["audio"])
    with torch.no_grad():
        assert torch.equal(audio.encode(built["audio"].eval(), inputs), audio.encode(source.eval(), inputs))


def test_whisper_takes_its_projector_width_from_the_llm(omni, tmp_path):
    """No ``options.hidden_size``: the projector maps to the LLM config's width,
    and the export records it, so the exported dir rebuilds on its own."""
    model = {
        "audio": {"family": "whisper", "path": str(omni["audio"])},
        "llm": {"family": "qwen2", "path": str(omni["llm"])},
    }
    from disagg.config.validate import validate

    data = {"train": str(omni["train"]), "media_root": str(omni["root"] / "data")}
    cfg = mixed_config(model, {}, data, tmp_path, 1, microbatches=1)
    audio = validate(cfg, get_registry()).modules["audio"].family
    assert audio.hidden_size() == 48 and audio.options["hidden_size"] == 48
    assert audio.build().projector.linear_2.out_features == 48


def test_audio_without_a_placeholder_in_the_llm_is_a_config_error(omni, tmp_path):
    """qwen2_5_vl's LLM has no audio token: refused at validation (not inside a
    Ray Data worker), naming the option that fixes it."""
    from disagg.config.errors import ConfigError

    model = {
        "audio": {"family": "whisper", "path": str(omni["audio"])},
        "llm": {"family": "qwen2_5_vl", "path": str(omni["vision"])},
    }
    data = {"train": str(omni["train"]), "media_root": str(omni["root"] / "data")}
    with pytest.raises(ConfigError) as err:
        mixed_config(model, {}, data, tmp_path, 1, microbatches=1)
    text = str(err.value)
    assert "model.llm.family" in text and "set model.llm.options.placeholder_tokens.audio" in text, text
    assert "needed by model.audio" in text, text
