"""Rank function of tests/test_lockstep.py (importable by spawned ranks): one step of a
strategy on this rank's samples, every ``torch.distributed`` collective it makes logged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from disagg.interfaces import CommCounter, OptimSpec
from disagg.testing import ranks

#: weight decay on: a zero-filled gradient would move a parameter the reference leaves alone
OPTIM = OptimSpec(lr=1e-3, weight_decay=0.1, eps=1e-3)


class CallLog(CommCounter):
    """Each collective in call order: its kind and the bytes it sends (a broadcast's differ by
    rank, source or not, so only its kind is kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, int | None]] = []

    def add(self, op: str, nbytes: int, calls: int = 1) -> None:
        super().add(op, nbytes, calls)
        self.log.append((op, None if op == "broadcast" else nbytes))


def strategy_class(name: str) -> Any:
    if name == "ulysses":
        from disagg_vision_sp.ulysses.strategy import UlyssesStrategy

        return UlyssesStrategy
    if name == "zero":
        from disagg_zero.strategy import ZeroStrategy

        return ZeroStrategy
    from disagg.builtin.ddp import DDPStrategy

    return DDPStrategy


def step_rank(
    rank: int, runs: list[tuple[str, dict]], path: str, inputs: list, grads: list, split: list[list[int]]
) -> bytes:
    """Per run: this rank's collectives over one step (encode, backward, reduce, norm, AdamW
    step: ``disagg_zero.comm.counted`` wraps ``torch.distributed``'s functions, DeepSpeed's
    references to them included), the group's squared norm, and (rank 0) the merged
    gradients and stepped parameters."""
    from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision
    from disagg_zero.comm import counted

    family = Qwen2_5_VLVision(Path(path))
    out = []
    for name, options in runs:
        ctx = ranks.rank_context("vision", rank, 1, len(split))
        strat = ranks.strategy_rank(strategy_class(name), family, ctx, options=options, optim=OPTIM)
        mine = split[rank]
        calls = CallLog()
        with counted(calls):
            shards = ranks.encode(strat, 0, [inputs[i] for i in mine])
            ranks.backward(strat, 0, shards, [grads[i][s.positions] for i, s in zip(mine, shards)])
            norm_sq = ranks.reduce(strat)
            ranks.step(strat, norm_sq, zero_grad=False)
        res: dict[str, Any] = {"calls": calls.log, "norm_sq": norm_sq}
        full = ranks.full_grads(strat)  # collectives: every rank
        params = ranks.full_state(strat)
        if rank == 0:
            res["grads"], res["params"] = full, params
        out.append(res)
    return ranks.dumps(out)


def hf_step(family: Any, inputs: list, grads: list) -> dict[str, Any]:
    """The single-process encoder over every sample, backward from the same upstream
    gradients, one torch AdamW step."""
    module = family.build(torch.float32)
    outs = [family.encode(module, x) for x in inputs]
    torch.autograd.backward(outs, grads)
    g = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    o = OPTIM
    opt = torch.optim.AdamW(
        module.parameters(), lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=o.eps, foreach=False
    )
    opt.step()
    params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"grads": g, "norm_sq": sum(float(v.double().pow(2).sum()) for v in g.values()), "params": params}
