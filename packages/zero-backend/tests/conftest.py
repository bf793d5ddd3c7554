"""Fixtures shared by the ``zero`` tests: one spawn of 2 ranks runs ``test_zero_uneven``'s
configurations and then ``test_zero_recipes``' (importing DeepSpeed and loading its CPU comm op
dominate a spawn: the recipes add only their own runs)."""

from __future__ import annotations

from typing import Any

import pytest
import uneven_harness as U
import zero_harness as H

from disagg.testing.dist import run_ranks
from disagg.testing.toy import ToyEncoderFamily, ToyLMFamily, make_toy_dirs


@pytest.fixture(scope="session")
def uneven_spawn(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each rank's results of :func:`uneven_harness.rank_all`, and the toy model dirs."""
    root = tmp_path_factory.mktemp("toy_uneven")
    enc, lm = make_toy_dirs(root)
    # hidden 384: qkv/proj/up/down exceed DeepSpeed's default
    # stage3_param_persistence_threshold (1e5 elements), so they are partitioned
    big = ToyEncoderFamily.make_tiny(root / "big_encoder", hidden=384)
    # 19M parameters (76 MB in fp32): big enough for the set-up's memory to show above the noise
    mem = ToyLMFamily.make_tiny(root / "mem_lm", hidden=768, layers=4, heads=8, vocab_size=64)
    ranks = H.tensors(run_ranks(U.rank_all, 2, enc, big, lm, mem, timeout=1500))
    return {"ranks": ranks, "enc": enc, "lm": lm, "big": big, "mem": mem}
