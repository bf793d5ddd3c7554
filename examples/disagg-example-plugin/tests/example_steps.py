"""One rank's training steps through a strategy's contract, as core's actor
calls it (encode -> the LLM's loss_and_backward -> the encoder's backward, per
microbatch; then reduce, global norm, clip, step, zero_grad): what a plugin
author runs on local gloo ranks (``disagg.testing.dist.run_ranks``)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import torch

from disagg.interfaces import GroupContext, OptimSpec, StrategyOptions, dropout_seed
from disagg.kit.strategy import clip_coefficient
from disagg.testing.toy import ToyEncoderFamily, ToyLMFamily, toy_samples

STEPS, BATCH, MICROBATCHES, CLIP, SEED = 3, 7, 2, 0.5, 0
# eps 1e-3: see test_orchestrator_ddp (keeps the 1e-5 parameter bound meaningful)
OPTIMS = {
    "vision": OptimSpec(
        lr=1e-2, weight_decay=0.1, eps=1e-3, total_steps=STEPS, scheduler="linear", warmup_steps=1
    ),
    "llm": OptimSpec(lr=2e-2, weight_decay=0.0, eps=1e-3, total_steps=STEPS),
}


def batches() -> list[list[dict[str, dict[str, torch.Tensor]]]]:
    """Ragged samples (1-2 images of different sizes, text-only ones)."""
    return [toy_samples(BATCH, seed=10 + s, text_only_every=3) for s in range(STEPS)]


def label_count(samples: list[dict[str, Any]]) -> int:
    return sum(int((s["llm"]["labels"][1:] != -100).sum()) for s in samples)  # labels shift by one


def mine(n: int, rank: int, world: int) -> list[int]:
    """Rank 0 takes the larger share (an uneven split across replicas)."""
    cut = (n * 2 + 2) // 3 if world == 2 else n
    return list(range(cut)) if rank == 0 else list(range(cut, n))


def train(rank: int, world: int, enc_dir: Path, lm_dir: Path, classes: list[type]) -> list[bytes]:
    """:func:`train_one` for each strategy class, one after the other."""
    return [train_one(rank, world, enc_dir, lm_dir, cls) for cls in classes]


def train_one(rank: int, world: int, enc_dir: Path, lm_dir: Path, strategy_cls: type) -> bytes:
    """Train both modules with ``strategy_cls``; per step the rank's loss sum,
    the global grad norm and both modules' full parameters (torch-saved)."""
    strats = {}
    for module, family in (("vision", ToyEncoderFamily(enc_dir)), ("llm", ToyLMFamily(lm_dir))):
        ctx = GroupContext(module, rank, world, 1, world, torch.device("cpu"), torch.float32, seed=SEED)
        torch.manual_seed(SEED)  # the worker's order: build under the seed, then reseed per replica
        strats[module] = strategy_cls(ctx, family, StrategyOptions())
        strats[module].setup(family.build(torch.float32), OPTIMS[module])
        strats[module].module.train()
    torch.manual_seed(dropout_seed(SEED, rank))
    enc, llm = strats["vision"], strats["llm"]
    out: dict[str, list] = {"loss_sum": [], "norm": [], "params": []}
    for step, samples in enumerate(batches()):
        scale, loss_sum = 1.0 / label_count(samples), 0.0
        idx = mine(len(samples), rank, world)
        for k in range(MICROBATCHES):
            part = [samples[i] for i in idx[k::MICROBATCHES]]
            mb = step * MICROBATCHES + k
            with_images = [s for s in part if "vision" in s]
            shards = enc.encode(mb, [s["vision"] for s in with_images])
            leaves = iter([sh.value.detach().clone().requires_grad_(True) for sh in shards])
            embeds = [{"vision": next(leaves)} if "vision" in s else {} for s in part]
            loss_sum += llm.loss_and_backward(mb, [s["llm"] for s in part], embeds, scale)
            grads = [e["vision"].grad for e in embeds if e]
            enc.backward(mb, [sh.value for sh in shards], grads)
        for s in (enc, llm):
            s.reduce_gradients()
        norm = math.sqrt(enc.grad_norm_sq() + llm.grad_norm_sq())
        for s in (enc, llm):
            s.step(clip_coefficient(norm, CLIP))
            s.zero_grad()
        out["loss_sum"].append(loss_sum)
        out["norm"].append(norm)
        out["params"].append({m: s.full_state_dict() for m, s in strats.items()})
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def load(raw: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(raw), weights_only=False)
