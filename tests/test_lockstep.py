"""One lockstep mechanism (``disagg.kit.lockstep``): ranks holding 0, 1 and 3 samples of a
microbatch make the same collectives, in the same order and of the same sizes, under
``ddp`` + ``shard: parameters`` (FSDP2), ``ulysses`` with an empty replica (FSDP2 over the
replicas) and ``zero`` stage 3 (DeepSpeed's per-submodule gathers), and each equals the
single-process Hugging Face encoder: gradients, squared norm, parameters after an AdamW step.

Collectives are logged per rank by wrapping ``torch.distributed``'s functions for the step.
A rank that skipped a placeholder would leave its peers waiting in a gather: the spawn has a
timeout, so such a fault fails the test instead of hanging it. One spawn of 3 gloo ranks.
"""

from __future__ import annotations

import lockstep_ranks as L
import pytest

from disagg.testing import ranks
from disagg.testing.dist import run_ranks
from disagg.testing.tolerance import assert_params_close, assert_scalar_close, assert_tensors_close

#: samples per rank of the one microbatch: none, one, three
SPLIT = [[], [0], [1, 2, 3]]
SIZES = [[(32, 16)], [(16, 16)], [(16, 32)], [(24, 24)]]
RUNS = [
    ("ddp", {"shard": "parameters"}),
    ("ulysses", {"shard": "parameters"}),
    ("zero", {"stage": 3}),
]
#: a rank left waiting at a collective fails the spawn after this many seconds
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("disagg_vision_sp")
    pytest.importorskip("disagg_zero")
    from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision
    from disagg_vision_sp.testing import random_images, upstream_grads

    path = Qwen2_5_VLVision.make_tiny(tmp_path_factory.mktemp("tiny") / "qwen2_5_vl")
    family = Qwen2_5_VLVision(path)
    inputs = [family.preprocess(random_images(s, seed=i)) for i, s in enumerate(SIZES)]
    grads = upstream_grads(family, inputs)
    raw = run_ranks(L.step_rank, len(SPLIT), RUNS, str(path), inputs, grads, SPLIT, timeout=TIMEOUT_S)
    return [ranks.loads(r) for r in raw], L.hf_step(family, inputs, grads)


@pytest.mark.parametrize("run", range(len(RUNS)), ids=[n for n, _ in RUNS])
def test_short_ranks_make_the_same_collectives_and_equal_hf(results, run: int) -> None:
    per_rank, hf = results
    name = RUNS[run][0]
    logs = [r[run]["calls"] for r in per_rank]
    # the sharded state's gathers happened (else equal logs would prove nothing)
    assert any(kind == "all_gather" for kind, _ in logs[0]), (name, logs[0][:8])
    for rank, log in enumerate(logs[1:], 1):
        assert log == logs[0], (
            f"{name}: rank {rank} ({len(SPLIT[rank])} samples) made {len(log)} collectives, "
            f"rank 0 (none) {len(logs[0])}"
        )
    got = per_rank[0][run]
    assert_tensors_close(got["grads"], hf["grads"], f"{name} grad ")
    for rank, r in enumerate(per_rank):
        assert_scalar_close(r[run]["norm_sq"], hf["norm_sq"], f"{name} rank {rank} squared grad norm")
    o = L.OPTIM
    assert_params_close(
        got["params"],
        hf["params"],
        lr=o.lr,
        steps=1,
        grads=hf["grads"],
        what=f"{name} after a step: ",
        eps=o.eps,
        betas=o.betas,
    )
