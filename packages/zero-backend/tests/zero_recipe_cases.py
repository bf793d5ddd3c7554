"""Rank function of ``zero``'s precision-recipe tests (importable by spawned ranks): the toy LM
under each ``train.precision`` recipe as ``zero`` stage 1, 2 and 3 over 2 ranks (uneven: 3
samples and 2), then each at 1 rank (``disagg.testing.recipes``' single-rank group, the two
processes each running a share), at the end of ``test_zero_uneven``'s spawn (``conftest.py``):
no spawn of its own. Under ``bf16`` each stage also runs over 2 ranks with each rank's samples
split into 2 microbatches, beside a 2-rank ``fp32`` run (stage 1) that the grad norms are held to.

The loss is the LM's summed cross-entropy over the global label count: positive and far from
0 at every step (about ln(vocab)), so the kit's relative loss tolerance means something (a
proxy such as sum <output, upstream gradient> crosses 0 as AdamW trains).

Each run also takes a census of what DeepSpeed holds, read from its own tensors (core's
census reads ``optimizer.state`` per module parameter, which DeepSpeed's flat partitions are
not): the dtypes of the weights, of what the optimizer steps, of the gradients it steps with
and of the AdamW moments, and the elements of each tensor for ``cost.zero_state_bytes``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from disagg.interfaces import OptimSpec
from disagg.testing import ranks
from disagg.testing.recipes import STEPS, recipe_steps, single_rank_group
from disagg.testing.toy import ToyLMFamily, toy_samples

RECIPES = ("bf16", "bf16-pure")
STAGES = (1, 2, 3)
#: eps above the bf16 gradient noise keeps AdamW's first update Lipschitz in the gradient
#: (disagg.testing.tolerance), as the other recipe tests
OPTIM = OptimSpec(lr=1e-3, eps=1e-3)
#: every tensor partitioned and gathered per submodule (the toy LM's are all small)
PER_LAYER = {
    "stage3_param_persistence_threshold": 0,
    "stage3_prefetch_bucket_size": 0,
    "stage3_max_reuse_distance": 0,
}
SAMPLES = 5


def samples() -> list[dict[str, Any]]:
    """Text and image samples with fixed "encoder" rows (the encoder's output, in the recipe's
    compute dtype when fed)."""
    out = toy_samples(SAMPLES, seed=11, text_only_every=3)
    g = torch.Generator().manual_seed(12)
    for x in out:
        n = int(x["vision"]["sizes"].sum()) if "vision" in x else 0
        x["embeds"] = {"vision": torch.randn(n, 24, generator=g)} if n else {}
    return out


def options(stage: int) -> dict[str, Any]:
    return {"stage": stage, "ds_config": {"zero_optimization": PER_LAYER}} if stage == 3 else {"stage": stage}


def census(strat: Any) -> dict[str, Any]:
    """What this rank holds, from DeepSpeed's tensors: dtypes of the weights (ZeRO-3: their
    partitions), the flat partitions the optimizer steps, their gradients (as the optimizer
    saw them) and AdamW's moments; each trainable parameter's elements."""
    ds = strat.engine.optimizer
    opt = strat.optimizer
    params = list(strat.module.parameters())
    weights = {getattr(p, "ds_tensor", p).dtype for p in params}
    stepped = [p for g in opt.param_groups for p in g["params"]] + list(opt.state)
    return {
        "weight_dtypes": weights,
        "param_dtypes": {p.dtype for p in stepped},
        "state_dtypes": {v.dtype for st in opt.state.values() for k, v in st.items() if k.startswith("exp_")},
        "numels": [getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad],
        "optimizer": type(ds).__name__,
        # MaskedAdamW's step counts (one per flat partition and one per fragment)
        "step_bytes": sum(
            v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items() if "step" in k
        ),
    }


def _grad_dtypes(strat: Any) -> set[torch.dtype]:
    """The gradients DeepSpeed steps with, captured as its optimizer's step begins."""
    return {p.grad.dtype for g in strat.optimizer.param_groups for p in g["params"] if p.grad is not None}


def _run(
    rank: int, path: str, world: int, stage: int, precision: str, data: list[dict], microbatches: int = 1
) -> dict:
    """``microbatches``: this rank's samples split into that many backwards before each step."""
    from disagg_zero import ZeroStrategy

    ctx = ranks.rank_context("llm", rank, 1, world, seed=3, precision=precision)
    strat = ranks.strategy_rank(
        ZeroStrategy, ToyLMFamily(Path(path)), ctx, options=options(stage), optim=OPTIM
    )
    strat.module.eval()  # compare arithmetic (the toy LM has no dropout anyway)
    total = sum(int((x["llm"]["labels"][1:] != -100).sum()) for x in data)
    # uneven over 2 ranks: 3 samples and 2
    mine = data if world == 1 else data[:3] if rank == 0 else data[3:]
    seen: dict[str, Any] = {"grad_dtypes": set(), "norms": []}
    step, norm_sq = strat.optimizer.step, strat.grad_norm_sq

    def spied(*a: Any, **k: Any) -> Any:
        seen["grad_dtypes"] |= _grad_dtypes(strat)
        return step(*a, **k)

    def norm_spied() -> float:
        seen["norms"].append(norm_sq() ** 0.5)  # the group's grad norm, each step
        return seen["norms"][-1] ** 2

    strat.optimizer.step = spied
    strat.grad_norm_sq = norm_spied

    def microbatch(strat: Any) -> float:
        loss = 0.0
        for mb in range(microbatches):  # the same global label count in each: a sum of parts
            part = mine[mb::microbatches]
            rows = ranks.leaves([{k: v.to(ctx.dtype) for k, v in x["embeds"].items()} for x in part])
            loss += ranks.loss_and_backward(strat, mb, [x["llm"] for x in part], rows, 1.0 / total)
            seen["embed_grad_dtypes"] = {v.grad.dtype for e in rows for v in e.values()}
        return loss

    out = recipe_steps(strat, microbatch, steps=STEPS)
    return {**out, **census(strat), **seen}


def zero_recipe_rank(rank: int, path: str) -> bytes:
    """Every (stage, recipe) over the 2 ranks; then each rank becomes a group of one and runs
        its share of the 1-rank runs (rank 0 stages 1-2, rank 1 stage 3), side by side. Run last in
        ``uneven_harness.rank_all``'s spawn; ``seconds`` / ``cpu_seconds``: its own wall and CPU time
    on this rank."""
    start, cpu = time.perf_counter(), time.process_time()
    data = samples()
    out: dict = {}
    for stage in STAGES:
        for precision in RECIPES:
            out[(stage, 2, precision)] = _run(rank, path, 2, stage, precision, data)
    # 2 microbatches per step (the runs above take one backward each): keyed with a 4th element
    for stage in STAGES:
        out[(stage, 2, "bf16", 2)] = _run(rank, path, 2, stage, "bf16", data, microbatches=2)
    out[(1, 2, "fp32")] = _run(rank, path, 2, 1, "fp32", data)  # their fp32 reference
    single_rank_group()
    # one world per process in a real run: DeepSpeed caches the 2 ranks' world group and
    # checks the environment's world size against the new one
    from deepspeed.utils import groups

    groups._WORLD_GROUP = None  # noqa: SLF001
    os.environ.update(WORLD_SIZE="1", RANK="0")
    for stage in (3,) if rank else (1, 2):
        for precision in RECIPES:
            out[(stage, 1, precision)] = _run(0, path, 1, stage, precision, data)
    out["seconds"] = time.perf_counter() - start
    out["cpu_seconds"] = time.process_time() - cpu  # this process's, whatever the machine's load
    return ranks.dumps(out)
