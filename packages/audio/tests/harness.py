"""Strategy-level equivalence harness for the audio families: ``ulysses`` or
``megatron_tp`` ranks (gloo, in processes) vs Hugging Face's own encoder
forward in one process (:func:`disagg_audio.testing.hf_reference`: what HF
computes and what the families define on top of it).

The reference and the ranks see the same samples and the same upstream
gradient (a fixed random tensor over each sample's full output). Reference
parameters that get no gradient stay absent (``None``), never zero-filled.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

from disagg.interfaces import EncoderFamily, GroupContext, OptimSpec


def ragged_clips(seconds: list[list[float]], rate: int = 16000, seed: int = 0) -> list[list[dict]]:
    """Per sample, decoded clips of the given lengths: chirps with noise, so that
    no two windows are alike."""
    rng = np.random.default_rng(seed)
    out = []
    for sample in seconds:
        items = []
        for s in sample:
            t = np.arange(int(s * rate)) / rate
            f0 = rng.uniform(200, 800)
            wave = 0.3 * np.sin(2 * np.pi * (f0 + 300 * t) * t) + 0.02 * rng.standard_normal(t.size)
            items.append({"array": wave.astype(np.float32), "sampling_rate": rate})
        out.append(items)
    return out


def upstream_grads(family: EncoderFamily, inputs: list[dict[str, torch.Tensor]], seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    hidden = family.hidden_size()
    return [torch.randn(sum(family.num_tokens(x)), hidden, generator=g) for x in inputs]


def _strategy(name: str) -> tuple[type, Any]:
    if name == "ulysses":
        from disagg.interfaces import StrategyOptions
        from disagg_vision_sp.ulysses.strategy import UlyssesStrategy

        return UlyssesStrategy, StrategyOptions()
    from disagg_llm_tp.strategy import MegatronTPOptions, MegatronTPStrategy

    return MegatronTPStrategy, MegatronTPOptions()


def strategy_rank(rank: int, strategy: str, degree: int, replicas: int, cases: list[tuple]) -> bytes:
    """For each case ``(family_cls, path, options, inputs, grads)``: replica ``r``
    encodes samples ``r::replicas``, backwards their rows, reduces gradients.
    Several cases share one spawn of the ranks (process start-up dominates)."""
    ctx = GroupContext(
        module="audio",
        rank=rank,
        world_size=degree * replicas,
        degree=degree,
        replicas=replicas,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    results = []
    for family_cls, path, options, inputs, grads in cases:
        family = family_cls(Path(path), options)
        cls, opts = _strategy(strategy)
        strat = cls(ctx, family, opts)
        strat.setup(family.build(torch.float32), OptimSpec(lr=1e-3))
        strat.module.train()
        mine = list(range(ctx.replica, len(inputs), replicas))
        shards = strat.encode(0, [inputs[i] for i in mine])
        strat.backward(0, [s.value for s in shards], [grads[i][s.positions] for i, s in zip(mine, shards)])
        strat.reduce_gradients()
        out: dict[str, Any] = {
            "samples": mine,
            "shards": [(s.positions, s.value.detach(), s.total) for s in shards],
            "all_to_all_bytes": int(ctx.comm.bytes_by_op.get("all_to_all", 0)),
            "grad_norm_sq": strat.grad_norm_sq(),
        }
        full = {n: g.clone() for n, g in strat.full_grads().items()}  # collective: every rank
        if rank == 0:
            out["grads"] = full
        ctx.comm.bytes_by_op.clear()
        results.append(out)
    buf = io.BytesIO()  # plain bytes: tensors through a queue die with the rank process
    torch.save(results, buf)
    return buf.getvalue()


def run_strategy(strategy: str, degree: int, replicas: int, cases: list[tuple]) -> list[list[dict]]:
    """Per case ``(family, inputs, grads)``, the results of every rank (by rank)."""
    from disagg.testing.dist import run_ranks

    packed = [(type(f), str(f.path), f.options, inputs, grads) for f, inputs, grads in cases]
    raw = run_ranks(strategy_rank, degree * replicas, strategy, degree, replicas, packed)
    per_rank = [torch.load(io.BytesIO(r), weights_only=False) for r in raw]
    return [[rank_results[c] for rank_results in per_rank] for c in range(len(cases))]


def assemble(results: list[dict], n_samples: int, hidden: int) -> list[torch.Tensor]:
    """Each sample's full embedding from every rank's shards; every row exactly once."""
    full: list[Any] = [None] * n_samples
    seen: list[Any] = [None] * n_samples
    for res in results:
        for i, (pos, val, total) in zip(res["samples"], res["shards"]):
            if full[i] is None:
                full[i] = torch.full((total, hidden), float("nan"))
                seen[i] = torch.zeros(total, dtype=torch.long)
            full[i][pos] = val
            seen[i][pos] += 1
    for i, s in enumerate(seen):
        assert s is not None and bool((s == 1).all()), f"sample {i}: rows not covered exactly once"
    return full


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of ``a`` against ``b`` over the whole tensor."""
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_matches(results: list[dict], ref_outs: list, ref_grads: dict, hidden: int) -> None:
    """Outputs and gradients per element against each tensor's own scale, the group's
    squared grad norm relative to its size (``disagg.testing.tolerance``); a gradient the
    reference lacks must be absent, never zero-filled."""
    from disagg.testing.tolerance import assert_scalar_close, assert_tensor_close, assert_tensors_close

    outs = assemble(results, len(ref_outs), hidden)
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert_tensor_close(o, r, f"sample {i} output")
    assert_tensors_close(results[0]["grads"], ref_grads, "grad ")
    ref_norm = sum(float(g.double().pow(2).sum()) for g in ref_grads.values())
    for res in results:
        assert_scalar_close(res["grad_norm_sq"], ref_norm, "squared grad norm")
