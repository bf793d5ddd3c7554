"""Rank function of ``test_sharded_checkpoint_tp`` (spawned ranks import it by name; it
imports llm-tp's ``tp_cases``, which that test puts on the path).

On 4 ranks: ``megatron_tp`` 2 x 2 replicas trains a step, saves it sharded
(``torch.distributed.checkpoint``, each rank its own pieces) and trains another;
then fresh groups of other layouts on the same 4 ranks resume from the save:
the same layout, ``megatron_tp`` 4 and ``ddp`` x 4, each compared after the load
and after the same second step; the TP 4 group saves in turn and TP 2 loads it.
Then the same with LoRA adapters (:func:`_lora`), which ``zero`` stage 3 x 4 resumes too
(:func:`_lora_zero3`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tp_cases import LR, MAX_NORM, label_count, replica_slice

from disagg.interfaces import OptimSpec
from disagg.interfaces.lora import LoraSpec
from disagg.kit.lora import apply_lora
from disagg.runtime.actor.state import load_full, save_full, save_sharded
from disagg.testing import ranks
from disagg.testing.ranks import dumps, loads


def _build(kind: str, rank: int, path: str) -> Any:
    from disagg_llm_tp.families.qwen2 import Qwen2Family

    fam = Qwen2Family(path)
    optim = OptimSpec(lr=LR, weight_decay=0.1)
    if kind == "ddp":
        from disagg.builtin.ddp import DDPStrategy

        return ranks.strategy_rank(DDPStrategy, fam, ranks.rank_context("llm", rank, 1, 4), optim=optim)
    from disagg_llm_tp.strategy import MegatronTPStrategy

    degree = int(kind[2:])
    ctx = ranks.rank_context("llm", rank, degree, 4 // degree)
    return ranks.strategy_rank(MegatronTPStrategy, fam, ctx, optim=optim)


def _step(strat: Any, samples: list[dict], embeds: list[dict]) -> None:
    ctx = strat.ctx
    mine = replica_slice(samples, ctx.replica, ctx.replicas)
    rows = replica_slice(embeds, ctx.replica, ctx.replicas)
    ranks.loss_and_backward(strat, 0, mine, ranks.leaves(rows), 1.0 / label_count(samples))
    ranks.step(strat, ranks.reduce(strat), MAX_NORM)


def _state(strat: Any) -> dict[str, torch.Tensor]:
    """Merged parameters and AdamW state, one flat dict."""
    out = {f"param/{k}": v for k, v in ranks.full_state(strat).items()}
    for name, st in strat.full_optimizer_state().items():
        out.update({f"optim/{name}/{k}": v for k, v in st.items()})
    return out


def ckpt_rank(rank: int, payload: bytes) -> bytes:
    path, root, samples, embeds = loads(payload)
    ckpt = Path(root)
    first = _build("tp2", rank, path)
    _step(first, samples, embeds)
    files = save_sharded(first, rank, ckpt, "llm")
    out: dict[str, Any] = {"files": files, "saved": _state(first)}
    _step(first, samples, embeds)
    out["uninterrupted"] = _state(first)
    for kind in ("tp2", "tp4", "ddp"):
        strat = _build(kind, rank, path)
        load_full(strat, rank, ckpt, "llm", restore_rng=kind == "tp2")
        out[f"{kind}/loaded"] = _state(strat)
        _step(strat, samples, embeds)
        out[f"{kind}/stepped"] = _state(strat)
        if kind == "tp4":  # a save from TP 4 (vocabulary padded, key/value heads copied)
            out["tp4/files"] = save_sharded(strat, rank, ckpt / "tp4", "llm")
    back = _build("tp2", rank, path)
    load_full(back, rank, ckpt / "tp4", "llm", restore_rng=False)
    out["tp4->tp2/loaded"] = _state(back)
    out["lora"] = _lora(rank, path, ckpt / "lora", samples, embeds)
    return dumps(out)


#: ZeRO-3 with the projections partitioned and the tensors of at most 1000 elements (the
#: adapters, norms, biases) persistent: held whole on every rank, re-gathered after a load
ZERO3 = {"stage": 3, "ds_config": {"zero_optimization": {"stage3_param_persistence_threshold": 1000}}}

#: column (q, k, v: key/value heads copied under TP 4) and row (o, down) adapters, dropout on
LORA = LoraSpec(r=4, alpha=8.0, dropout=0.1, targets=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"))


def _build_lora(kind: str, rank: int, path: str) -> Any:
    """As core's worker sets a LoRA module up: the strategy's own build (empty under
    megatron_tp), PEFT's adapters injected, then the strategy's set-up; train mode."""
    from disagg_llm_tp.families.qwen2 import Qwen2Family

    fam = Qwen2Family(path)
    options: dict[str, Any] = {}
    if kind == "ddp":
        from disagg.builtin.ddp import DDPStrategy as cls

        ctx = ranks.rank_context("llm", rank, 1, 4)
    elif kind == "zero3":
        from disagg_zero import ZeroStrategy as cls

        ctx = ranks.rank_context("llm", rank, 1, 4)
        options = ZERO3
    else:
        from disagg_llm_tp.strategy import MegatronTPStrategy as cls

        ctx = ranks.rank_context("llm", rank, int(kind[2:]), 4 // int(kind[2:]))
    strat = cls(ctx, fam, cls.options_model(**options))
    module = strat.build_module()
    if not cls.lora_step:  # megatron_tp applies its adapters itself, on its parallel linears
        module = apply_lora(module, LORA, "llm", "lora")
    optim = OptimSpec(lr=LR, weight_decay=0.1, lora=LORA)
    return ranks.strategy_rank(cls, fam, ctx, options=options, optim=optim, module=module, train=True)


def _lora(rank: int, path: str, ckpt: Path, samples: list[dict], embeds: list[dict]) -> dict[str, Any]:
    """LoRA under megatron_tp 2 x 2: a step, a sharded save (trained tensors only), another
    step; resumed in the same layout (random streams too: the adapters' dropout), in TP 4
    and in ddp x 4; and the same state saved in the full form and loaded back, for the bytes
    each resume reads (the full form's, too, only this rank's pieces of the trained tensors)."""
    first = _build_lora("tp2", rank, path)
    _step(first, samples, embeds)
    out: dict[str, Any] = {"files": save_sharded(first, rank, ckpt, "llm", LORA), "saved": _state(first)}
    save_full(first, rank, ckpt / "full", "llm", LORA)
    _step(first, samples, embeds)
    out["uninterrupted"] = _state(first)
    for kind in ("tp2", "tp4", "ddp"):
        strat = _build_lora(kind, rank, path)
        out[f"{kind}/read"] = load_full(strat, rank, ckpt, "llm", kind == "tp2", LORA)
        out[f"{kind}/loaded"] = _state(strat)
        if kind == "tp2":
            _step(strat, samples, embeds)
            out["tp2/stepped"] = _state(strat)
    strat = _build_lora("tp2", rank, path)
    strat.full_state_dict = _no_merge  # type: ignore[method-assign]  # a LoRA resume never merges the base
    out["full/read"] = load_full(strat, rank, ckpt / "full", "llm", True, LORA)
    del strat.full_state_dict
    out["full/loaded"] = _state(strat)
    out.update(_lora_zero3(rank, path, ckpt, samples, embeds))
    return out


def _lora_zero3(rank: int, path: str, ckpt: Path, samples: list[dict], embeds: list[dict]) -> dict[str, Any]:
    """``zero`` stage 3 x 4 resumes the TP 2 LoRA checkpoint, sharded then (after a step that
    moves the state) full-form: DeepSpeed's partitions filled from the pieces overlapping them,
    the base never merged; and the bytes this rank's pieces of the trained state hold (its
    partition of each adapter, fp32 master and two moments, and the step scalars)."""
    strat = _build_lora("zero3", rank, path)
    own = 0
    for p in strat.module.parameters():
        if p.requires_grad:
            part = p.ds_tensor.numel()
            own += max(0, min(part, p.ds_numel - rank * part)) * 4 * 3 + 4
    out: dict[str, Any] = {"zero3/own": own}
    for form, where in (("sharded", ckpt), ("full", ckpt / "full")):
        strat.full_state_dict = _no_merge  # type: ignore[method-assign]
        out[f"zero3/{form}/read"] = load_full(strat, rank, where, "llm", False, LORA)
        strat.refresh_weights()  # as core's worker does after a load: the masters into the weights
        del strat.full_state_dict
        out[f"zero3/{form}/loaded"] = _state(strat)
        if form == "sharded":
            _step(strat, samples, embeds)
    return out


def _no_merge() -> dict:
    raise AssertionError("resuming LoRA from the full form merged the module's whole state")
