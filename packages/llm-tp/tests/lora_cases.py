"""LoRA under megatron_tp vs the single-process PEFT model: the rank function and the
reference (spawned ranks import this module by name)."""

from __future__ import annotations

import torch
from tp_cases import LR, MAX_NORM, label_count

from disagg.interfaces import OptimSpec
from disagg.interfaces.lora import LoraSpec, lora_seed
from disagg.testing import ranks
from disagg.testing.ranks import dumps, loads
from disagg.testing.reference import reference_adamw

#: column linears (q, k, v; the MLP's gate) and row linears (o, down) of every layer
SPEC = LoraSpec(r=4, alpha=8.0, dropout=0.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"))
OPTIM = OptimSpec(lr=LR, eps=1e-3, lora=SPEC)
STEPS = 3


def reference(path: str, samples: list[dict], steps: int = STEPS) -> dict:
    """PEFT's LoRA on the HF model (its own LoraConfig, nothing of the code under test but the
    seed), one process, clipped AdamW over the adapters."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = LoraConfig(r=SPEC.r, lora_alpha=SPEC.alpha, lora_dropout=0.0, target_modules=list(SPEC.targets))
    torch.manual_seed(lora_seed(SPEC.seed, "llm"))
    inject_adapter_in_model(cfg, model)
    model.lm_head.requires_grad_(False)  # outside the decoder PEFT froze; a tied one already is
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = reference_adamw(params.values(), OPTIM)
    total = label_count(samples)
    out: dict = {"loss": [], "grads": []}
    for _ in range(steps):
        loss_sum = torch.zeros(())
        for s in samples:
            logits = model(input_ids=s["input_ids"][None], use_cache=False).logits[0]
            loss_sum = loss_sum + torch.nn.functional.cross_entropy(
                logits[:-1], s["labels"][1:], ignore_index=-100, reduction="sum"
            )
        (loss_sum / total).backward()
        out["loss"].append(float(loss_sum.detach()))
        out["grads"].append({n: p.grad.detach().clone() for n, p in params.items()})
        torch.nn.utils.clip_grad_norm_(list(params.values()), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["initial"] = initial
    return out


def _tp_lora(rank: int, path: str, spec, optim, options: dict, train: bool = False):  # noqa: ANN001, ANN202
    """``megatron_tp`` 2 on the tiny Qwen2 with ``spec``'s adapters, set up as core's worker
    sets it up: the module the strategy built empty (meta device, no base weight allocated),
    whose ranks load their own slices, and the adapters applied by the strategy's own LoRA
    step on its parallel linears (``lora_step``: no PEFT layers injected). ``(ctx, strategy)``."""
    from disagg_llm_tp.families.qwen2 import Qwen2Family
    from disagg_llm_tp.strategy import MegatronTPOptions, MegatronTPStrategy

    ctx = ranks.rank_context("llm", rank, 2, 1)
    fam = Qwen2Family(path)
    opts = MegatronTPOptions(**options)
    empty = MegatronTPStrategy(ctx, fam, opts).build_module()
    assert all(p.is_meta for p in empty.parameters()), "megatron_tp builds the module empty"
    assert MegatronTPStrategy.lora_step, "megatron_tp applies its adapters itself"
    strat = ranks.strategy_rank(
        MegatronTPStrategy, fam, ctx, options=opts, optim=optim, module=empty, train=train
    )
    return ctx, strat


def tp_lora_rank(rank: int, payload: bytes) -> bytes:
    """``payload``: (family path, samples, [strategy options per case]); one record per case.
    A case that recomputes runs in train mode (HF's checkpointing layers replay only then;
    the tiny model draws no dropout) and counts the adapters' calls inside a replay."""
    from disagg.kit.recompute import replaying
    from disagg_llm_tp.lora import TPLoraLinear

    path, samples, cases = loads(payload)
    outs = []
    for options in cases:
        recompute = options.get("recompute", "none") != "none"
        ctx, strat = _tp_lora(rank, path, SPEC, OPTIM, options, train=recompute)
        calls = {False: 0, True: 0}  # adapter calls in the forward, in a replay

        def count(*_: object, calls: dict = calls) -> None:
            calls[replaying()] += 1

        for m in strat.module.modules():
            if isinstance(m, TPLoraLinear):
                m.register_forward_pre_hook(count)
        total = label_count(samples)
        rec: dict = {"loss": [], "grads": [], "norm_sq": []}
        for _ in range(STEPS):
            rec["loss"].append(ranks.loss_and_backward(strat, 0, samples, [{} for _ in samples], 1.0 / total))
            norm_sq = ranks.reduce(strat)
            rec["norm_sq"].append(norm_sq)
            rec["grads"].append(ranks.full_grads(strat))
            ranks.step(strat, norm_sq, MAX_NORM)
        rec["params"] = ranks.full_state(strat)
        rec["trainable"] = sorted(n for n, p in strat.module.named_parameters() if p.requires_grad)
        rec["collectives"] = dict(ctx.comm.bytes_by_op)
        rec["adapter_calls"] = (calls[False], calls[True])
        outs.append(rec)
    return dumps(outs)


def tp_lora_dropout_rank(rank: int, payload: bytes) -> bytes:
    """Adapter dropout under TP 2: one step with ``recompute`` none and full (same seeds);
    the masks each adapter drew (in call order) and the merged gradients."""
    from dataclasses import replace

    from disagg.testing.dropout import dropout_spy

    path, samples = loads(payload)
    spec = replace(SPEC, dropout=0.3)
    optim = replace(OPTIM, lora=spec)
    out = {}
    for mode in ("none", "full"):
        _, strat = _tp_lora(rank, path, spec, optim, {"recompute": mode}, train=True)
        with dropout_spy() as masks:  # the kit's spy: a replay in backward would be recorded too
            ranks.loss_and_backward(strat, 0, samples, [{} for _ in samples], 1.0 / label_count(samples))
        ranks.reduce(strat)
        out[mode] = {"masks": masks, "grads": ranks.full_grads(strat)}
    return dumps(out)


def tp_lora_all(rank: int, payload: bytes) -> bytes:
    """Both rank functions in one spawn (the suite's time: one process start, one import)."""
    main, dropout = loads(payload)
    return dumps((loads(tp_lora_rank(rank, main)), loads(tp_lora_dropout_rank(rank, dropout))))
