"""``build.renamed_keys`` (which checkpoint key fills which parameter in a sliced ZeRO-3 load)
under both shapes of transformers' private ``_apply_weight_conversions_to_state_dict``: one dict
(transformers 5.17, the GPU host's) and a generator of dicts (the release installed here)."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.deepspeed as hf_ds
from torch import nn

from disagg_zero.build import renamed_keys


class Tower(nn.Module):
    base_model_prefix = "model"

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 2)
        self.norm = nn.LayerNorm(2)


def _checkpoint(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors as a checkpoint saves them: under the base model's prefix."""
    return {f"model.{k}": v for k, v in model.state_dict().items()}


WANT = {
    "proj.weight": "model.proj.weight",
    "proj.bias": "model.proj.bias",
    "norm.weight": "model.norm.weight",
    "norm.bias": "model.norm.bias",
}


def test_generator_form() -> None:
    model = Tower()
    assert renamed_keys(model, _checkpoint(model), []) == WANT


def test_single_dict_form(monkeypatch: pytest.MonkeyPatch) -> None:
    real = hf_ds._apply_weight_conversions_to_state_dict

    def as_one_dict(*args, **kwargs):
        out = real(*args, **kwargs)
        if isinstance(out, dict):
            return out
        merged: dict = {}
        for part in out:
            merged.update(part)
        return merged

    monkeypatch.setattr(hf_ds, "_apply_weight_conversions_to_state_dict", as_one_dict)
    model = Tower()
    assert renamed_keys(model, _checkpoint(model), []) == WANT
