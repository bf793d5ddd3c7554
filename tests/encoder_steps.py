"""Several optimizer steps of a vision encoder under one strategy, one call per
rank (importable by spawned ranks), and the same steps in one process with the
unpartitioned Hugging Face module.

``schedule[step][replica]`` lists the sample ids a replica encodes in that
step (possibly none). The upstream gradient of each sample is fixed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from disagg.interfaces import OptimSpec
from disagg.testing import ranks
from disagg.testing.reference import reference_adamw

MAX_NORM = 0.05  # small enough that clipping is active
# weight decay on; eps 1e-3 keeps Adam's update Lipschitz in the gradient, so
# fp32 rounding noise of near-zero gradients (SigLIP's key biases) stays noise
OPTIM = OptimSpec(lr=1e-3, weight_decay=0.1, eps=1e-3)


def _strategy(name: str) -> type:
    if name == "ulysses":
        from disagg_vision_sp.ulysses.strategy import UlyssesStrategy

        return UlyssesStrategy
    from disagg_llm_tp.strategy import MegatronTPStrategy

    return MegatronTPStrategy


def steps_rank(
    rank: int, strategy: str, degree: int, replicas: int, path: str, inputs, grads, schedule
) -> bytes:
    from disagg_vision_sp.families.llava import LlavaVision

    ctx = ranks.rank_context("vision", rank, degree, replicas)
    family = LlavaVision(Path(path))
    strat = ranks.strategy_rank(_strategy(strategy), family, ctx, optim=OPTIM, train=True)  # as the worker
    out: dict = {"present": [], "norm_sq": [], "grads": {}}
    for step, per_replica in enumerate(schedule):
        mine = per_replica[ctx.replica]
        ranks.encode_and_backward(strat, step, [inputs[i] for i in mine], [grads[i] for i in mine])
        norm_sq = ranks.reduce(strat)
        out["present"].append(sorted(ranks.full_grads(strat)))
        out["norm_sq"].append(norm_sq)
        ranks.step(strat, norm_sq, MAX_NORM)
    out["params"] = ranks.full_state(strat)
    with_state = {id(p) for p in strat.optimizer.state}
    out["with_state"] = sorted(n for n, p in strat.module.named_parameters() if id(p) in with_state)
    return ranks.dumps(out)


def run_steps(strategy: str, degree: int, replicas: int, path: str, inputs, grads, schedule) -> list[dict]:
    from disagg.testing.dist import run_ranks

    raw = run_ranks(steps_rank, degree * replicas, strategy, degree, replicas, path, inputs, grads, schedule)
    return [ranks.loads(r) for r in raw]


def reference_steps(family, inputs, grads, schedule) -> dict:  # noqa: ANN001
    """The single-process run: every replica's samples of a step together."""
    module = family.build(torch.float32)
    module.train()
    params = dict(module.named_parameters())
    opt = reference_adamw(params.values(), OPTIM)
    out: dict = {"present": [], "norm_sq": [], "grads": {}}
    for per_replica in schedule:
        ids = [i for r in per_replica for i in r]
        outs = [family.encode(module, inputs[i]) for i in ids]
        torch.autograd.backward(outs, [grads[i] for i in ids])
        present = {n: p.grad for n, p in params.items() if p.grad is not None}
        out["present"].append(sorted(present))
        for n, g in present.items():  # each parameter's first gradient: the lr-unit bound's input
            out["grads"].setdefault(n, g.detach().clone())
        out["norm_sq"].append(sum(float(g.double().pow(2).sum()) for g in present.values()))
        torch.nn.utils.clip_grad_norm_(list(params.values()), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = {n: p.detach().clone() for n, p in params.items()}
    out["with_state"] = sorted(n for n, p in params.items() if p in opt.state)
    return out
