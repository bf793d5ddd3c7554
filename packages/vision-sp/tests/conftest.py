"""Tiny model dirs, built once per test session (random weights, offline)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision

    return Qwen2_5_VLVision.make_tiny(tmp_path_factory.mktemp("tiny") / "qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from disagg_vision_sp.families.llava import LlavaVision

    return LlavaVision.make_tiny(tmp_path_factory.mktemp("tiny") / "llava")


@pytest.fixture(scope="session")
def tiny_llava_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llava-1.5's layout: CLIP tower, CLS dropped from the features."""
    from disagg_vision_sp.families.tiny_llava import make_tiny_llava

    return make_tiny_llava(tmp_path_factory.mktemp("tiny") / "llava_clip", tower="clip")


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from disagg_vision_sp.families.qwen2_vl import Qwen2VLVision

    return Qwen2VLVision.make_tiny(tmp_path_factory.mktemp("tiny") / "qwen2_vl")


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from disagg_vision_sp.families.qwen3_vl import Qwen3VLVision

    return Qwen3VLVision.make_tiny(tmp_path_factory.mktemp("tiny") / "qwen3_vl")
