"""Rank function of the context-parallel test (spawned ranks import it by name): one step of
``ddp`` or ``megatron_tp`` with ``context_parallel`` on text-only Qwen2 samples, against the
single-process Hugging Face model (computed by every rank, same weights)."""

from __future__ import annotations

from typing import Any

import torch
from tp_cases import family_cls

from disagg.interfaces import GroupContext, OptimSpec
from disagg.kit.context_parallel import current, padded_length
from disagg.kit.context_parallel.cost import kv_exchange
from disagg.kit.recompute.activations import saved_bytes_hooks
from disagg.testing import ranks
from disagg.testing.ranks import dumps, loads


def text_batch(vocab: int, lengths: tuple[int, ...], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Ragged text-only samples (one shorter than the CP degree when ``lengths`` has one)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(20, vocab, (n,), generator=g)
        labels = ids.clone()
        labels[: min(2, n - 1)] = -100  # a prompt, and at least one label
        out.append({"input_ids": ids, "labels": labels})
    return out


def reference(path: str, samples: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Sum of the token losses / global label count and the weight gradients of the HF model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    labels = sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    total = 0.0
    for s in samples:
        out = model(input_ids=s["input_ids"][None], use_cache=False)
        logits = out.logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits, s["labels"][1:], ignore_index=-100, reduction="sum")
        (loss / labels).backward()
        total += float(loss)
    return {"loss": total, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def one_step(strategy: str, path: str, samples: list, rank: int, degree: int, cp: int, replicas: int) -> dict:
    ctx = GroupContext(
        "llm",
        rank,
        degree * cp * replicas,
        degree,
        replicas,
        torch.device("cpu"),
        torch.float32,
        context_parallel=cp,
    )
    fam = family_cls("qwen2")(path)
    opts: dict[str, Any] = {"loss_chunk_tokens": None}
    if strategy == "megatron_tp":
        from disagg_llm_tp.strategy import MegatronTPStrategy as cls
    else:
        from disagg.builtin.ddp import DDPStrategy as cls
    strat: Any = ranks.strategy_rank(cls, fam, ctx, options=opts, optim=OptimSpec(lr=1e-3))
    mine = samples[ctx.replica :: replicas]  # uneven replicas when len(samples) is odd
    labels = sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    ctx.comm.reset()
    saved: list[int] = []  # bytes autograd saves for backward (the strategy's activation_bytes)
    with saved_bytes_hooks(strat.module, saved.append):
        loss = ranks.loss_and_backward(strat, 0, mine, [{} for _ in mine], 1.0 / labels)
    gathered = dict(ctx.comm.bytes_by_op), dict(ctx.comm.calls_by_op)
    norm_sq = ranks.reduce(strat)
    grads = ranks.full_grads(strat)
    ranks.step(strat, norm_sq, zero_grad=False)  # AdamW's state exists after its first step
    tc = fam.text_config
    longest = max(len(s["input_ids"]) for s in mine)
    est = kv_exchange(
        tc.num_hidden_layers,
        len(mine),
        padded_length(longest, cp),
        tc.num_key_value_heads // degree,
        tc.hidden_size // tc.num_attention_heads,
        cp,
        4,
    )
    return {
        "rank": rank,
        "replica": ctx.replica,
        "cp_rank": ctx.cp_rank,
        "loss": loss,
        "grads": grads,
        "saved_bytes": sum(saved),
        "state_bytes": ranks.state_bytes(strat),
        "norm_sq": norm_sq,
        "bytes": gathered[0],
        "calls": gathered[1],
        "estimate": est,
        "active": current() is not None,
    }


def recipe_run(path: str, samples: list, rank: int, cp: int, precision: str) -> dict:
    """``disagg.testing.recipes.recipe_steps`` of ``ddp`` at ``cp`` (the whole world, or a
    group of one at 1) under ``precision``: each CP rank returns its replica's loss."""
    from dropout_cases import BF16_OPTIM, SEED

    from disagg.builtin.ddp import DDPStrategy
    from disagg.interfaces.precision import RECIPES
    from disagg.testing.recipes import recipe_steps

    recipe = RECIPES[precision]
    ctx = GroupContext(
        "llm",
        rank,
        cp,
        1,
        1,
        torch.device("cpu"),
        recipe.weights,
        seed=SEED,
        recipe=recipe,
        context_parallel=cp,
    )
    fam = family_cls("qwen2")(path)
    strat: Any = ranks.strategy_rank(DDPStrategy, fam, ctx, optim=BF16_OPTIM)
    strat.module.eval()
    total = sum(int((s["labels"][1:] != -100).sum()) for s in samples)

    def microbatch(strat: Any) -> float:
        return ranks.loss_and_backward(strat, 0, samples, [{} for _ in samples], 1.0 / total)

    return recipe_steps(strat, microbatch, copies=cp)


def lora_steps(
    strategy: str, path: str, samples: list, rank: int, degree: int, cp: int, replicas: int
) -> dict:
    """``lora_cases.STEPS`` clipped AdamW steps of ``strategy`` at ``context_parallel`` ``cp``
    with ``lora_cases.SPEC``'s adapters, set up as core's worker sets them up: PEFT layers
    injected before set-up for ``ddp`` (``disagg.kit.lora.apply_lora``), none for
    ``megatron_tp`` (``lora_step``: it wraps its parallel linears after
    ``context_parallel.apply``). Per step: the replica's loss, the norm, the merged gradients."""
    from lora_cases import OPTIM, STEPS
    from tp_cases import MAX_NORM

    from disagg.kit.lora import apply_lora

    world = degree * cp * replicas
    cpu = torch.device("cpu")
    ctx = GroupContext("llm", rank, world, degree, replicas, cpu, torch.float32, context_parallel=cp)
    fam = family_cls("qwen2")(path)
    opts: dict[str, Any] = {"loss_chunk_tokens": None}
    if strategy == "megatron_tp":
        from disagg_llm_tp.strategy import MegatronTPStrategy as cls
    else:
        from disagg.builtin.ddp import DDPStrategy as cls
    module = cls(ctx, fam, cls.options_model(**opts)).build_module()
    if not cls.lora_step:
        module = apply_lora(module, OPTIM.lora, "llm", "train.modules.llm.lora")
    strat: Any = ranks.strategy_rank(cls, fam, ctx, options=opts, optim=OPTIM, module=module)
    mine = samples[ctx.replica :: replicas]
    labels = sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    rec: dict[str, Any] = {"replica": ctx.replica, "active": current() is not None, "loss": [], "norm_sq": []}
    rec["grads"] = []
    for _ in range(STEPS):
        rec["loss"].append(ranks.loss_and_backward(strat, 0, mine, [{} for _ in mine], 1.0 / labels))
        norm_sq = ranks.reduce(strat)
        rec["norm_sq"].append(norm_sq)
        rec["grads"].append(ranks.full_grads(strat))
        ranks.step(strat, norm_sq, MAX_NORM)
    rec["params"] = ranks.full_state(strat)
    rec["trainable"] = sorted(n for n, p in strat.module.named_parameters() if p.requires_grad)
    return rec


def cp_rank(rank: int, payload: bytes) -> bytes:
    """``payload``: (path, samples, cases, precision, lora cases); a case is (strategy, degree,
    cp, replicas); then ``precision`` at CP 4 and, on rank 0 alone, at CP 1; then the LoRA
    cases (:func:`lora_steps`) and, on rank 0, the PEFT reference of them."""
    path, samples, cases, precision, lora = loads(payload)
    out: list[Any] = [one_step(s, path, samples, rank, d, c, r) for s, d, c, r in cases]
    out.append(recipe_run(path, samples, rank, 4, precision))
    # before single_rank_share: every rank leaves the spawned group there
    adapted = [lora_steps(s, path, samples, rank, d, c, r) for s, d, c, r in lora]
    from disagg.testing.recipes import single_rank_share

    for p in single_rank_share([precision], rank, 4):  # rank 0, in a group of one
        out.append(recipe_run(path, samples, 0, 1, p))
        out.append(reference(path, samples))
    out.append(adapted)
    if rank == 0 and lora:
        from lora_cases import reference as peft_reference

        out.append(peft_reference(path, samples))
    return dumps(out)


def fsdp_rank(rank: int, payload: bytes) -> bytes:
    """``payload``: (path, samples, modes): per mode, one step of ``ddp`` CP 2 x 2 replicas with
    ``shard: <mode>`` (FSDP2 over the 4 ranks) where replica 1 has no sample (it forwards the
    placeholder), then a forward-only evaluation of the same split; rank 0 adds the reference."""
    from disagg.builtin.ddp import DDPStrategy

    path, samples, modes = loads(payload)
    labels = sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    out: list[Any] = []
    for mode in modes:
        ctx = GroupContext("llm", rank, 4, 1, 2, torch.device("cpu"), torch.float32, context_parallel=2)
        fam = family_cls("qwen2")(path)
        opts = {"loss_chunk_tokens": None, "shard": mode}
        strat: Any = ranks.strategy_rank(DDPStrategy, fam, ctx, options=opts, optim=OptimSpec(lr=1e-3))
        mine = samples if ctx.replica == 0 else []
        loss = ranks.loss_and_backward(strat, 0, mine, [{} for _ in mine], 1.0 / labels)
        norm_sq = ranks.reduce(strat)
        with torch.no_grad():
            evaluated = ranks.evaluate(strat, mine, [{} for _ in mine])
        grads = ranks.full_grads(strat)
        out.append(
            {"replica": ctx.replica, "loss": loss, "norm_sq": norm_sq, "eval": evaluated, "grads": grads}
        )
    if rank == 0:
        out.append(reference(path, samples))
    return dumps(out)
