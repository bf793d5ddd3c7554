"""Bad configurations are reported by ``UlyssesStrategy.check`` before any actor starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from disagg.interfaces import EncoderFamily, StrategyOptions
from disagg_vision_sp.families.llava import LlavaVision
from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision
from disagg_vision_sp.ulysses.layout import plan_bounds
from disagg_vision_sp.ulysses.strategy import UlyssesStrategy


def check(family: Any, degree: int, replicas: int = 1) -> list[str]:
    return UlyssesStrategy.check(family, degree, replicas, StrategyOptions())


def test_good_meshes_pass(tiny_qwen, tiny_llava):
    for fam in (Qwen2_5_VLVision(tiny_qwen), LlavaVision(tiny_llava)):
        for degree in (1, 2, 4):
            assert check(fam, degree, 2) == []


def test_heads_not_divisible_by_degree(tiny_qwen, tiny_llava):
    for fam in (Qwen2_5_VLVision(tiny_qwen), LlavaVision(tiny_llava)):
        (msg,) = check(fam, 3)
        assert "parallel.vision.degree=3" in msg
        assert "4 attention heads" in msg
        assert "1, 2, 4" in msg


class NoHooks(EncoderFamily):
    name = "no_hooks"
    modality = "image"

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        return nn.Linear(2, 2)

    def export_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    def preprocess(self, media: list[Any]) -> dict[str, torch.Tensor]:
        return {}

    def num_tokens(self, inputs: dict[str, torch.Tensor]) -> list[int]:
        return []

    def encode(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.zeros(0, 2)


def test_family_without_hook_points():
    (msg,) = check(NoHooks("/nowhere"), 2)
    assert "'no_hooks' does not support strategy 'ulysses'" in msg
    assert "ddp" in msg


def test_bad_attention_backend(tiny_qwen):
    (msg,) = check(Qwen2_5_VLVision(tiny_qwen, {"attn_implementation": "flex"}), 2)
    assert "attn_implementation='flex'" in msg and "sdpa, eager, flash_attention_2" in msg


def test_llava_unsupported_feature_strategy(tiny_llava, tmp_path: Path):
    bad = tmp_path / "llava_default"
    shutil.copytree(tiny_llava, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["vision_feature_select_strategy"] = "default"
    (bad / "config.json").write_text(json.dumps(cfg))
    (msg,) = check(LlavaVision(bad), 2)
    assert "vision_feature_select_strategy='default'" in msg and "'full'" in msg


def test_small_images_are_legal_and_shards_may_be_empty():
    # One 4-token image at degree 4: the cut plan leaves ranks empty instead of failing,
    # so an image smaller than the degree is not an error (those ranks still join the all-to-all).
    assert plan_bounds([0, 4], 4, 4) == [0, 0, 0, 4, 4]  # ties go left
    assert plan_bounds(list(range(0, 101, 4)), 100, 4) == [0, 24, 48, 76, 100]
