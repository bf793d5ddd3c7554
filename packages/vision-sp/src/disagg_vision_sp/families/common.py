"""Small pieces the vision families share: media loading, processors, model-type checks, the
tower-plus-projector base of LLaVA and InternVL (checkpoint key names and quiet loading are
core's family kit, ``disagg.kit.hf``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from disagg.interfaces import EncoderFamily, UlyssesFamily
from disagg.kit.hf import checkpoint_keys, empty_from_config, find_prefix, quiet_transformers


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

    try:
        return AutoImageProcessor.from_pretrained(path, **overrides)
    except ImportError:
        # transformers 5.17 without torchvision (a bare GPU host, a pinned container) makes
        # AutoImageProcessor itself a placeholder that raises; later releases fall back to the
        # PIL backend on their own. Take the PIL class of the type the dir names, as they do.
        pil = _pil_image_processor(Path(path))
        if pil is None:
            raise
        return pil.from_pretrained(path, **overrides)


def _pil_image_processor(path: Path) -> Any:
    """The PIL-backend class of ``path``'s ``image_processor_type`` (None where there is none)."""
    import transformers

    cfg = path / "preprocessor_config.json"
    name = json.loads(cfg.read_text()).get("image_processor_type", "") if cfg.is_file() else ""
    return (
        getattr(transformers, name.removesuffix("Fast").removesuffix("Pil") + "Pil", None) if name else None
    )


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


class TowerProjectorFamily(UlyssesFamily, EncoderFamily):
    """A whole VLM dir's vision tower and ``multi_modal_projector`` (LLaVA, InternVL): the
    dir's config read once per instance (checks ask for it per mesh: ``disagg plan`` asks ~100
    times), and the build, names and parts both families share. A subclass gives
    ``encoder_class`` (the VLM minus its language model, loadable with ``from_pretrained``)."""

    modality: ClassVar[str] = "image"
    #: where the tower lives in the dir's files (transformers 5 adds ``model.``)
    prefixes: ClassVar[tuple[str, ...]] = ("", "model.")

    @staticmethod
    def encoder_class() -> type:
        raise NotImplementedError

    def config(self) -> Any:
        return self.hf_config()

    def hidden_size(self) -> int:
        return int(self.config().text_config.hidden_size)

    def _attn(self) -> str:
        return self.options.get("attn_implementation", "sdpa")

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        with quiet_transformers():
            return self.encoder_class().from_pretrained(
                self.path,
                key_mapping={
                    r"^model\.vision_tower\.": "vision_tower.",
                    r"^model\.multi_modal_projector\.": "multi_modal_projector.",
                },
                dtype=dtype,
                attn_implementation=self._attn(),
            )

    def build_empty(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """``build()``'s tower and projector on the meta device (sharding strategies read only
        their own slices)."""
        return empty_from_config(
            self.encoder_class(), self.config(), dtype=dtype, attn_implementation=self._attn()
        )

    def checkpoint_name(self, name: str) -> str:
        # the inverse of build()'s key_mapping: the dir's own prefix
        if getattr(self, "_prefix", None) is None:
            probe = "multi_modal_projector.linear_1.weight"
            self._prefix = find_prefix(checkpoint_keys(self.path), probe, self.prefixes)
        return self._prefix + name

    def parts(self) -> dict[str, tuple[str, ...]]:
        return {"tower": ("vision_tower.*",), "projector": ("multi_modal_projector.*",)}

    def export_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.checkpoint_name(k): v for k, v in state.items()}
