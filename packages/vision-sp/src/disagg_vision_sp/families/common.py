"""Small pieces the vision families share: media loading, processors, model-type checks
(checkpoint key names and quiet loading are core's family kit, ``disagg.kit.hf``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any


def load_image(item: Any) -> Any:
    """A PIL RGB image from a PIL image, a path, or an HWC uint8 array."""
    from PIL import Image

    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if isinstance(item, (str, Path)):
        with Image.open(item) as im:
            return im.convert("RGB")
    return Image.fromarray(item).convert("RGB")


@functools.lru_cache(maxsize=8)
def image_processor(path: str, **overrides: int) -> Any:
    """The family's own processor (cached per dir: data workers call preprocess per sample);
    ``overrides`` (e.g. ``max_pixels``) replace what its ``preprocessor_config.json`` says."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path, **overrides)


#: which family reads a dir of each ``model_type`` (for "use family X" hints)
FAMILY_OF_MODEL_TYPE = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_5": "qwen3_5",
    "llava": "llava",
    "internvl": "internvl",
}


def check_model_type(path: Path, family: str, model_types: tuple[str, ...]) -> list[str]:
    """A dir of another model type would fail later with a raw AttributeError
    on a config field it lacks; say which family reads it instead."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return [f"model.vision.path={str(path)!r} has no config.json (not a Hugging Face model dir)"]
    model_type = json.loads(cfg.read_text()).get("model_type")
    if model_type in model_types or str(model_type).removesuffix("_vision") in model_types:
        return []  # a whole VLM, or a tower saved on its own
    other = FAMILY_OF_MODEL_TYPE.get(model_type)
    hint = f"; use family {other!r}" if other else ""
    return [
        f"model.vision.path={str(path)!r} is a {model_type!r} model, which family {family!r} cannot read "
        f"(it reads {', '.join(model_types)}){hint}"
    ]
