"""The recipe table ``train.precision`` names: bytes per parameter element and ``auto``."""

import pytest
import torch

from disagg.interfaces import RECIPES, resolve_precision


@pytest.mark.parametrize(
    ("name", "trainable", "frozen"),
    # fp32: 4 weight + 4 grad + 8 moments; bf16: + a 4-byte master beside a 2-byte weight;
    # bf16-pure: 2 weight + 2 grad + 4 moments (the published run's 8 B/param)
    [("fp32", 16, 4), ("bf16", 18, 2), ("bf16-pure", 8, 2)],
)
def test_state_bytes_per_element(name: str, trainable: int, frozen: int) -> None:
    recipe = RECIPES[name]
    assert recipe.state_bytes_per_element() == trainable
    assert recipe.state_bytes_per_element(trainable=False) == frozen


def test_auto_is_fp32_on_cpu_and_bf16_on_cuda() -> None:
    assert resolve_precision("auto", "cpu").weights == torch.float32
    assert resolve_precision("auto", "cuda").name == "bf16"
    with pytest.raises(ValueError, match="allowed: auto, fp32, bf16, bf16-pure"):
        resolve_precision("fp16", "cpu")
