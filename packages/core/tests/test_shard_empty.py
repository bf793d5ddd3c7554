"""An encoder rank that holds no rows of a sample still sends a shard for it: that empty shard must
be on the rank's device in its dtype, or a GPU transport gets a CPU tensor next to CUDA ones. The
meta device stands in for CUDA here (a CPU tensor beside it fails as it would beside a CUDA one)."""

from __future__ import annotations

import pytest
import torch

from disagg.interfaces import EmbeddingShard


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_empty_shard_takes_the_device_and_dtype_of_the_ranks_output(dtype: torch.dtype) -> None:
    out = torch.empty(5, 8, dtype=dtype, device="meta")  # another rank's rows, on the accelerator
    shard = EmbeddingShard.empty(10, 8, like=out)
    assert (shard.value.device, shard.value.dtype, tuple(shard.value.shape)) == (out.device, dtype, (0, 8))
    assert shard.positions.device == EmbeddingShard.whole(out).positions.device  # CPU, as whole()'s
    # what the receiver does with every rank's rows of a sample: one tensor
    assert torch.cat([EmbeddingShard.whole(out).value, shard.value]).shape == (5, 8)


def test_empty_shard_without_a_reference_is_cpu_float32() -> None:
    shard = EmbeddingShard.empty(3, 4)
    assert (shard.value.device.type, shard.value.dtype, shard.total) == ("cpu", torch.float32, 3)
