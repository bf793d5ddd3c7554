"""Rank function of the sharded-state tests (``parallel.<m>.shard``), importable by spawned ranks.

Three optimizer steps of a strategy on this rank's replica's samples (``plans[replicas][step]
[microbatch][replica]``: sample indices, uneven, some replica empty), from a fixed upstream gradient per
sample: the group's squared norm and merged gradients per step, then the merged parameters and
AdamW state and this rank's measured state bytes. Every shard mode runs in the same spawn.
A run whose options name ``lora`` (a key of :data:`LORA`) trains PEFT adapters on the tower, as
core's worker sets them up: injected after the strategy's build, before its set-up.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from disagg.interfaces import OptimSpec
from disagg.interfaces.lora import LoraSpec
from disagg.testing import ranks

#: weight decay on: a zero-filled gradient would move a parameter the reference leaves alone
OPTIM = OptimSpec(lr=1e-3, weight_decay=0.1, eps=1e-3)
MAX_NORM = 1.0
#: the tower's fused qkv and its output projection adapted, the merger trained in full
#: (``modules_to_save``, resolved as core resolves the family's ``merger`` part)
LORA = {
    "lora": LoraSpec(
        r=4,
        alpha=8.0,
        dropout=0.0,
        targets=("attn.qkv", "attn.proj"),
        modules_to_save=("merger",),
        save_patterns=("merger.*",),
    )
}
#: dropout on the adapters' input: its runs train in train mode (masks drawn, from the rank's
#: shard stream under ulysses, as the tower's own dropout)
LORA["lora-dropout"] = replace(LORA["lora"], dropout=0.25)


def strategy_class(name: str) -> Any:
    if name == "ulysses":
        from disagg_vision_sp.ulysses.strategy import UlyssesStrategy

        return UlyssesStrategy
    from disagg.builtin.ddp import DDPStrategy

    return DDPStrategy


def steps_rank(
    rank: int, runs: list[tuple[str, int, int, dict]], path: str, inputs, grads, plans, ckpt: str
) -> bytes:
    """``runs``: (strategy, degree, replicas, options) in turn on the same ranks; ``plans``:
    replicas -> the plan of that many replicas (the same samples per step); ``ckpt``: a dir
    the ranks share, for the sharded checkpoints' round trips."""
    from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision

    family = Qwen2_5_VLVision(Path(path))
    out = []
    for name, degree, replicas, options in runs:
        ctx = ranks.rank_context("vision", rank, degree, replicas)
        options = dict(options)
        lora = LORA[options.pop("lora")] if "lora" in options else None
        strat = _strategy(name, family, ctx, options, lora)
        res: dict[str, Any] = {"norms": [], "grads": [], "mlp_calls": _count_mlp_calls(strat.module)}
        for step, microbatches in enumerate(plans[replicas]):
            for k, per_replica in enumerate(microbatches):
                mine = per_replica[ctx.replica]
                mb = 10 * step + k
                shards = ranks.encode(strat, mb, [inputs[i] for i in mine])
                ranks.backward(strat, mb, shards, [grads[i][s.positions] for i, s in zip(mine, shards)])
            norm_sq, full = ranks.finish_step(strat, MAX_NORM, zero_grad=False)
            res["norms"].append(norm_sq)
            res["grads"].append(full if rank == 0 else None)
            # what the worker's record reads: after the step, before the next zero_grad
            res["state_bytes"] = ranks.state_bytes(strat)
            ranks.zero_grad(strat)
        res["params"] = ranks.full_state(strat)
        res["optim"] = strat.full_optimizer_state()
        if options.get("shard", "none") == "none":
            out.append(res)
            continue
        # a checkpoint's round trip: the full form (rank 0's is complete) loaded back into the
        # same set-up after its parameters and AdamW state were wiped
        import torch
        import torch.distributed as dist

        from disagg.kit.sharding import fsdp

        payload = [res["params"], res["optim"]]
        dist.broadcast_object_list(payload, src=0)
        with torch.no_grad():
            for p in strat.module.parameters():
                fsdp.local(p).zero_()
        inner = getattr(strat.optimizer, "optim", strat.optimizer)  # ZeroRedundancyOptimizer's own
        inner.state.clear()
        strat.load_full_state(*payload)
        res["reloaded"] = (ranks.full_state(strat), strat.full_optimizer_state())
        res.update(_sharded_round_trip(strat, Path(ckpt) / f"{len(out)}", name, ctx, family, options, lora))
        out.append(res)
    return ranks.dumps(out)


def _strategy(name: str, family: Any, ctx: Any, options: dict, lora: LoraSpec | None) -> Any:
    """The strategy set up on this rank; with ``lora``, on its own build with the adapters in.
    In train mode, as core's worker runs it, where the run recomputes whole blocks (HF's
    checkpointing layers replay only in train mode; the tiny tower draws no dropout) or its
    adapters draw dropout."""
    train = options.get("recompute") == "full" or (lora is not None and lora.dropout > 0)
    if lora is None:
        return ranks.strategy_rank(
            strategy_class(name), family, ctx, options=options, optim=OPTIM, train=train
        )
    from disagg.kit.lora import apply_lora

    cls = strategy_class(name)
    module = apply_lora(cls(ctx, family, cls.options_model(**options)).build_module(), lora, "vision", "lora")
    optim = replace(OPTIM, lora=lora)
    return ranks.strategy_rank(cls, family, ctx, options=options, optim=optim, module=module, train=train)


def _count_mlp_calls(module: Any) -> dict[str, int]:
    """Calls of the tower blocks' MLPs in the forward and in a replay (``recompute: full`` replays
    each block's forward in backward; the block's own hooks stay outside the checkpoint)."""
    from disagg.kit.recompute import replaying

    calls = {"forward": 0, "replayed": 0}

    def count(*_: Any) -> None:
        calls["replayed" if replaying() else "forward"] += 1

    for n, m in module.named_modules():
        if re.search(r"(^|\.)blocks\.\d+\.mlp$", n):  # the blocks' (not the merger's)
            m.register_forward_pre_hook(count)
    return calls


def _sharded_round_trip(  # noqa: ANN001
    strat, where: Path, name: str, ctx, family, options: dict, lora: LoraSpec | None
) -> dict[str, Any]:
    """A sharded checkpoint's round trip, as the actor's: every rank writes its own pieces
    (``sharded_state``, through DCP), then reads them back into the same set-up wiped, and
    into a fresh unsharded one (``shard: none``) of the same layout."""
    import torch

    from disagg.kit.checkpoint import load_pieces, payload_by_file, save_pieces
    from disagg.kit.sharding import fsdp

    save_pieces(strat.sharded_state(), where)
    with torch.no_grad():
        for p in strat.module.parameters():
            fsdp.local(p).zero_()
    getattr(strat.optimizer, "optim", strat.optimizer).state.clear()
    load_pieces(strat.sharded_state, where, str(where))
    out: dict[str, Any] = {"dcp_reloaded": (ranks.full_state(strat), strat.full_optimizer_state())}
    plain = _strategy(name, family, ctx, {**options, "shard": "none"}, lora)
    load_pieces(plain.sharded_state, where, str(where))
    out["dcp_unsharded"] = (ranks.full_state(plain), plain.full_optimizer_state())
    out["dcp_files"] = payload_by_file(where)
    return out
