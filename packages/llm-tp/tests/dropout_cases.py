"""Rank functions for the dropout and bf16 tests (importable by spawned ranks).

Dropout masks are observed with a spy on ``torch.nn.functional.dropout``,
which HF's eager attention calls on the attention probabilities: the mask of
a call is where a positive probability came out zero.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from tp_cases import dumps

from disagg.interfaces import GroupContext, OptimSpec, compute_dtype, dropout_seed

SEED = 7
P = 0.25  # attention_dropout of the tiny model
#: the bf16 step's AdamW: eps above the bf16 gradient noise keeps the first update Lipschitz in
#: the gradient (with eps ~0 it is lr * sign(g), and a noise-level element's sign flips by rounding:
#: Adam's hard limit, 2 lr; ``disagg.testing.tolerance``), as the end-to-end configs' eps = 1e-3
BF16_OPTIM = OptimSpec(lr=1e-3, eps=1e-3)


@contextlib.contextmanager
def dropout_spy() -> Iterator[list[torch.Tensor]]:
    """Record the kept/dropped mask of every active dropout call (``True`` = kept),
    over the positions whose input was nonzero (causal and padding zeros excluded)."""
    masks: list[torch.Tensor] = []
    real = F.dropout

    def spy(x, p=0.5, training=True, inplace=False):  # noqa: ANN001
        out = real(x, p, training, inplace)
        if training and p > 0:
            masks.append(torch.where(x.detach() != 0, (out.detach() != 0).to(torch.int8), -1))
        return out

    F.dropout = spy
    try:
        yield masks
    finally:
        F.dropout = real


def _strategy(rank: int, path: str, degree: int, replicas: int, optim: OptimSpec | None = None):
    from disagg_llm_tp.families.qwen2 import Qwen2Family
    from disagg_llm_tp.strategy import MegatronTPOptions, MegatronTPStrategy

    ctx = GroupContext(
        module="llm",
        rank=rank,
        world_size=degree * replicas,
        degree=degree,
        replicas=replicas,
        device=torch.device("cpu"),
        dtype=torch.float32,
        seed=SEED,
    )
    fam = Qwen2Family(path, {"attn_implementation": "eager"})
    strat = MegatronTPStrategy(ctx, fam, MegatronTPOptions())
    strat.setup(fam.build(torch.float32), optim or OptimSpec(lr=1e-3))
    # What core's worker does after set-up: train mode, the default RNG per replica.
    strat.module.train()
    torch.manual_seed(dropout_seed(SEED, ctx.replica))
    return strat


def _leaves(embeds: list[dict]) -> list[dict]:
    return [{k: v.clone().requires_grad_(True) for k, v in e.items()} for e in embeds]


def tp_dropout_rank(rank: int, path: str, degree: int, replicas: int, samples, embeds, draws: int) -> bytes:
    """Every replica gets the same samples, so masks could only differ by seed."""
    out: dict = {}
    for run in ("first", "again"):  # a fresh set-up with the same seed
        strat = _strategy(rank, path, degree, replicas)
        leaves = _leaves(embeds)
        with dropout_spy() as masks:
            loss = strat.loss_and_backward(0, samples, leaves, 1.0)
        out[run] = {
            "loss": loss,
            "masks": masks,
            # the forks leave the default stream alone: TP ranks keep drawing alike on it
            "default_rng": torch.get_rng_state(),
            "embed_grads": [{k: v.grad for k, v in e.items()} for e in leaves],
        }
    with torch.no_grad():  # fresh draws of the same stream, for the statistics
        out["losses"] = [strat.evaluate(samples, embeds)[0] for _ in range(draws)]
    if degree == 1:
        strat.reduce_gradients()
        out["grads"] = strat.full_grads()
    return dumps(out)


def tp_bf16_rank(rank: int, path: str, degree: int, samples, embeds) -> bytes:
    """One step in fp32 and one under core's bf16 autocast, from the same weights."""
    total = sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    out: dict = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        strat = _strategy(rank, path, degree, 1, BF16_OPTIM)
        strat.module.eval()  # compare arithmetic, not dropout masks
        leaves = _leaves(embeds)
        with compute_dtype(torch.device("cpu"), dtype):
            loss = strat.loss_and_backward(0, samples, leaves, 1.0 / total)
        strat.reduce_gradients()
        norm_sq = strat.grad_norm_sq()
        grads = {n: g.clone() for n, g in strat.full_grads().items()}  # collective: every rank
        strat.step(1.0)
        out[name] = {
            "loss": loss,
            "norm_sq": norm_sq,
            "grads": grads,
            "embed_grads": [{k: v.grad for k, v in e.items()} for e in leaves],
            "param_dtypes": {p.dtype for p in strat.module.parameters()},
            "grad_dtypes": {p.grad.dtype for p in strat.module.parameters() if p.grad is not None},
            "state_dtypes": {
                v.dtype for st in strat.optimizer.state.values() for v in st.values() if v.dim() > 0
            },
            "params": strat.full_state_dict(),
        }
    return dumps(out)
