"""The families' image processor where ``AutoImageProcessor`` itself cannot load (transformers
5.17 without torchvision, as on the GPU host's image without its torchvision or any pinned
container): the PIL class of the dir's ``image_processor_type`` is taken, and it processes an
image to the same pixels and grid as the processor ``AutoImageProcessor`` picks here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from disagg_vision_sp.families import common


class _NoAuto:
    """What ``from transformers import AutoImageProcessor`` gives in 5.17 without torchvision: a
    placeholder whose loader raises. Set on the module ``sys.modules`` holds when the test runs
    (5.17's own placeholder raises on any attribute access, so it cannot be patched in place; and
    the ``transformers`` this file imported may no longer be the one registered there)."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise ImportError("AutoImageProcessor requires the Torchvision library (as transformers 5.17 says)")


@pytest.fixture
def no_auto(monkeypatch: pytest.MonkeyPatch):
    common.image_processor.cache_clear()
    monkeypatch.setattr(sys.modules["transformers"], "AutoImageProcessor", _NoAuto)
    yield
    common.image_processor.cache_clear()


def _image() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(45, 61, 3), dtype=np.uint8)


def test_the_pil_class_of_the_dir_is_taken_and_agrees(
    tiny_qwen: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = [common.load_image(_image())]
    common.image_processor.cache_clear()
    auto = common.image_processor(str(tiny_qwen))(images=image, return_tensors="pt")
    common.image_processor.cache_clear()
    monkeypatch.setattr(sys.modules["transformers"], "AutoImageProcessor", _NoAuto)
    try:
        proc = common.image_processor(str(tiny_qwen))
    finally:
        common.image_processor.cache_clear()
    assert type(proc).__name__ == "Qwen2VLImageProcessorPil"
    got = proc(images=image, return_tensors="pt")
    assert torch.equal(got["image_grid_thw"], auto["image_grid_thw"])
    # the same class here (no torchvision): the same pixels; torchvision's resize differs slightly
    torch.testing.assert_close(got["pixel_values"], auto["pixel_values"], rtol=0, atol=2e-2)


def test_a_dir_without_a_pil_class_raises_the_import_error(tmp_path: Path, no_auto) -> None:
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "NoSuchProcessor"})
    )
    with pytest.raises(ImportError, match="Torchvision"):
        common.image_processor(str(tmp_path))
