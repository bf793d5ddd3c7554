"""The check's model and samples, built locally: the tiny Qwen2.5-VL dir (``disagg make-tiny``'s
families, random weights, nothing downloaded) and captioned images of different sizes drawn as
the demo dataset draws them (shapes whose colour and form the captions name), preprocessed by
the data pipeline's own :func:`~disagg.data.preprocess.preprocess_record` (no Ray)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FAMILY = "qwen2_5_vl"


@dataclass
class Batch:
    """One global batch: per sample, each module's input dict (``vision`` absent: text only)."""

    samples: list[dict[str, dict[str, torch.Tensor]]]

    @property
    def label_tokens(self) -> int:
        return sum(int((s["llm"]["labels"][1:] != -100).sum()) for s in self.samples)

    def with_noise_images(self, seed: int = 7) -> Batch:
        """The same batch with every image's pixels replaced by Gaussian noise of the same shape
        (the preprocessed pixels are normalized, so noise has their scale)."""
        g = torch.Generator().manual_seed(seed)
        out = []
        for s in self.samples:
            s = dict(s)
            if "vision" in s:
                v = dict(s["vision"])
                v["pixel_values"] = torch.randn(v["pixel_values"].shape, generator=g)
                s["vision"] = v
            out.append(s)
        return Batch(out)


def make_model_dir(out: Path) -> Path:
    """The tiny whole-VLM dir (both roles read it), built by the registered families."""
    from disagg.cli.make_tiny import make_tiny

    manifest = make_tiny(out, [FAMILY], data=False)
    if FAMILY not in manifest["models"]:
        raise RuntimeError(f"make-tiny could not build {FAMILY}: {manifest['skipped'].get(FAMILY)}")
    return Path(manifest["models"][FAMILY])


#: (width, height) of each sample's images; () a text-only sample. Several sizes, a wide and a
#: tall one, so the vision tower's windows and the LLM's mRoPE positions both vary
CPU_IMAGES: tuple[tuple[tuple[int, int], ...], ...] = (((56, 84),), ((112, 56), (56, 56)), ())
CUDA_IMAGES: tuple[tuple[tuple[int, int], ...], ...] = (((224, 336),), ((448, 224), (168, 168)), ())


def make_batch(model_dir: Path, families: dict[str, Any], work: Path, images: tuple, seed: int = 0) -> Batch:
    """Captioned shapes of the given sizes, preprocessed into the modules' inputs."""
    from disagg.data.demo_data import COLOURS, SHAPES, caption, draw_shape
    from disagg.data.preprocess import preprocess_record
    from disagg.data.records import Record

    rng = random.Random(seed)
    tok = families["llm"].tokenizer()
    samples = []
    for i, sizes in enumerate(images):
        paths, words = [], []
        for j, (w, h) in enumerate(sizes):
            colour, shape = rng.choice(list(COLOURS)), rng.choice(list(SHAPES))
            im = draw_shape(colour, shape, max(w, h), rng).resize((w, h))
            path = work / f"s{i}_{j}.png"
            im.save(path)
            paths.append(str(path))
            words.append(caption(colour, shape))
        if paths:
            prompt = "<image>\n" * len(paths) + "Describe."
            answer = " ".join(words)
        else:
            prompt, answer = "Name a colour.", "Red, like a square."
        messages = [("user", prompt), ("assistant", answer)]
        rec = Record(0, i, f"gpucheck:{i}", messages, {"image": paths} if paths else {})
        samples.append(preprocess_record(rec, families, tok).inputs)
    return Batch(samples)


def families_from_registry(model_dir: Path, registry: Any) -> dict[str, Any]:
    """The vision and LLM families of the tiny dir, looked up by name in the plugin registry."""
    fams = {}
    for module, role in (("vision", "encoder"), ("llm", "llm")):
        try:
            cls = registry.family(role, FAMILY)
        except KeyError:
            raise RuntimeError(
                f"family {FAMILY!r} ({role}) is not registered: install disagg-vision-sp and disagg-llm-tp"
            ) from None
        fams[module] = cls(model_dir, {"attn_implementation": "sdpa"})
    return fams
