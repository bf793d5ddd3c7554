"""zero's estimate reads the LLM's ``loss_chunk_tokens`` as ddp's does: under every stage each rank
computes the whole vocabulary for its own tokens, so the logits it holds at once, and the change
from whole to chunked, are ddp's."""

from __future__ import annotations

import pytest

pytest.importorskip("disagg_vision_sp")

from disagg.bench.published import QWEN2_5_VL_32B  # noqa: E402
from disagg.builtin.ddp import DDPStrategy  # noqa: E402
from disagg.interfaces import CostQuery  # noqa: E402
from disagg.plan.published import published_shapes  # noqa: E402
from disagg_zero.strategy import ZeroStrategy  # noqa: E402


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_counts_the_configured_loss_chunk(stage: int) -> None:
    shapes = published_shapes(QWEN2_5_VL_32B)
    q = CostQuery(shape=shapes["llm"], degree=1, replicas=8, seq_len=16384, precision="bf16", samples=8)

    def act(cls, **opts) -> int:
        return cls.estimate(q, cls.options_model(**opts)).activation_bytes

    zero_whole, zero_chunk = (
        act(ZeroStrategy, stage=stage, loss_chunk_tokens=None),
        act(ZeroStrategy, stage=stage),
    )
    ddp_whole, ddp_chunk = act(DDPStrategy, loss_chunk_tokens=None), act(DDPStrategy)
    assert zero_whole > zero_chunk
    assert zero_whole - zero_chunk == ddp_whole - ddp_chunk
