"""Uneven splits, empty replicas, steps without samples and never-used
parameters: single-process references and the per-rank driver.

A step is a list of microbatches; a microbatch gives each rank a (possibly
empty) list of sample indices, and every rank is called for every
microbatch, as core's orchestrator calls every group. A step with no
microbatch is a text-only global batch for the encoder: only ``zero_grad``,
``reduce_gradients``, ``grad_norm_sq`` and ``step`` run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import zero_harness as H
from torch import nn

from disagg.interfaces import compute_dtype
from disagg.testing import ranks
from disagg.testing.toy import ToyEncoderConfig, ToyEncoderFamily, ToyLMFamily

#: per step, per microbatch, per rank (2 ranks): sample indices
ENCODER_PLAN: list[list[list[list[int]]]] = [
    [[[0, 1], [2]], [[3], []]],  # 3 over 2, then 1 over 2 (rank 1 empty)
    [],  # no image in the global batch: the encoder group gets no call but the step
    [[[], [0]], [[1, 2], [3]]],  # rank 0 empty first
]
LLM_PLAN: list[list[list[list[int]]]] = [
    [[[0, 1], [2]], [[3], []]],
    [[[], [0]], [[1], [2, 3]]],
]


def plan_samples(plan: list[list[list[int]]]) -> list[int]:
    return sorted(i for mb in plan for part in mb for i in part)


class UnusedLayerEncoderFamily(ToyEncoderFamily):
    """The toy encoder plus a layer its forward never calls, like LLaVA's
    unused last SigLIP layer: its parameters never get a gradient."""

    def preprocess(self, media: list[Any]) -> dict[str, torch.Tensor]:
        """The toy family reads tensors only; a picture (the black image a ZeRO-3 rank
        without samples forwards, ``disagg.kit.sharding.placeholder_input``) becomes
        one item of 4 zero patches."""
        from PIL import Image

        if media and isinstance(media[0], Image.Image):
            in_dim = ToyEncoderConfig.from_pretrained(self.path).in_dim
            media = [torch.zeros(4, in_dim) for _ in media]
        return super().preprocess(media)

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        module = super().build(dtype)
        with torch.random.fork_rng():
            torch.manual_seed(11)
            module.unused = nn.Linear(module.config.hidden, 8).to(dtype)
        return module


# -- references -------------------------------------------------------------------------------------
def _ref_steps(module: nn.Module, opt: Any) -> dict[str, float | None]:
    """Per parameter: AdamW's step count, None where it has no state (never stepped)."""
    return {
        n: (float(opt.state[p]["step"]) if p in opt.state else None) for n, p in module.named_parameters()
    }


def reference_encoder(enc_dir: Path) -> dict[str, Any]:
    fam = UnusedLayerEncoderFamily(enc_dir)
    module = fam.build()
    opt, sched = H._ref_optim(module)
    out: dict[str, Any] = {"norm": [], "grads": [], "initial": H.portable(module.state_dict())}
    for step, plan in enumerate(ENCODER_PLAN):
        samples = encoder_samples(step)
        idx = plan_samples(plan)
        loss = (
            sum((fam.encode(module, samples[i]["vision"]) * samples[i]["out_grad"]).sum() for i in idx)
            if idx
            else None
        )
        norm, grads = H._ref_step(module, opt, sched, loss)
        out["norm"].append(norm)
        out["grads"].append(grads)
    out["params"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    out["steps"] = _ref_steps(module, opt)
    out["lr"] = opt.param_groups[0]["lr"]
    return out


def reference_llm(lm_dir: Path) -> dict[str, Any]:
    """The single-process LLM over every step's whole batch (zero_harness's reference)."""
    return H.reference_llm(lm_dir, 2, len(LLM_PLAN))


def encoder_samples(step: int) -> list[dict[str, Any]]:
    """Four image samples (1-2 items each) with fixed output gradients."""
    samples = [x for x in H.toy_samples(12, seed=40 + step) if "vision" in x][:4]
    g = torch.Generator().manual_seed(500 + step)
    for x in samples:
        x["out_grad"] = torch.randn(int(x["vision"]["sizes"].sum()), 24, generator=g) * 0.1
    return samples


# -- ranks ------------------------------------------------------------------------------------------
def _fragment_steps(strat: Any) -> dict[str, list[float]]:
    """Per parameter: the step counts of its fragments on this rank, and
    whether their AdamW moments are all zero."""
    names = {
        i: n for i, (n, p) in enumerate((n, p) for n, p in strat.module.named_parameters() if p.requires_grad)
    }
    out: dict[str, list[Any]] = {}
    opt = strat.optimizer
    # ZeRO-3 puts each flat partition into the param group only while it
    # steps it; the state keeps them all
    flats = list(opt.state) + [p for g in opt.param_groups for p in g["params"] if p not in opt.state]
    for flat in flats:
        state = opt.state.get(flat, {})
        for k, (start, n, idx) in enumerate(opt.fragments_of(flat)):
            if not state:
                out.setdefault(names[idx], []).append((0.0, True))
                continue
            moments = [state[key].view(-1).narrow(0, start, n) for key in ("exp_avg", "exp_avg_sq")]
            zero = all(bool((m == 0).all()) for m in moments)
            out.setdefault(names[idx], []).append((float(state["fragment_steps"][k]), zero))
    return out


def _layout(strat: Any) -> dict[str, tuple[int, int, int]]:
    """Per parameter: (full size, this rank's partition size, size of its data outside a gather)."""
    return {
        n: (
            int(getattr(p, "ds_numel", p.numel())),
            int(p.ds_tensor.numel()) if hasattr(p, "ds_tensor") else -1,
            p.numel(),
        )
        for n, p in strat.module.named_parameters()
    }


def _probe(strat: Any) -> Any:
    """DeepSpeed's per-layer gathering, measured (stage 3 only)."""
    from disagg_zero.runtime import GatherProbe

    return GatherProbe(strat.engine, strat.module) if strat.options.stage == 3 else None


def _gathered(strat: Any, probe: Any) -> dict[str, Any]:
    """The most bytes held whole at once, the whole module's partitioned bytes and the tensors."""
    if probe is None:
        return {}
    whole = sum(p.ds_numel * p.element_size() for p in probe.params)
    named = [(n, tuple(p.ds_shape)) for n, p in strat.module.named_parameters()]
    return {"peak": probe.peak, "fetches": probe.fetches, "whole": whole, "named": named}


def rank_encoder(rank: int, enc_dir: Path, options: dict[str, Any]) -> dict[str, Any]:
    fam = UnusedLayerEncoderFamily(enc_dir)
    strat = H._strategy(rank, 2, "vision", fam, options)
    probe = _probe(strat)
    rec: dict[str, Any] = {"norm": [], "grads": [], "layout": _layout(strat)}
    for step, plan in enumerate(ENCODER_PLAN):
        samples = encoder_samples(step)
        ranks.zero_grad(strat)
        for mb, parts in enumerate(plan):
            mine = [samples[i] for i in parts[rank]]
            shards = ranks.encode(strat, mb, [x["vision"] for x in mine])
            ranks.backward(strat, mb, shards, [x["out_grad"] for x in mine])
        H._finish_step(strat, rec)
    rec["gathered"] = _gathered(strat, probe)
    rec["params"] = ranks.full_state(strat)
    rec["steps"] = _fragment_steps(strat)
    rec["lr"] = ranks.current_lr(strat)
    return H.portable(rec)


def rank_llm(
    rank: int, lm_dir: Path, options: dict[str, Any], dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    fam = ToyLMFamily(lm_dir)
    strat = H._strategy(rank, 2, "llm", fam, options)
    probe = _probe(strat)
    rec: dict[str, Any] = {"loss_sum": [], "norm": [], "grads": [], "embed_grads": []}
    for plan, samples in zip(LLM_PLAN, H.llm_batches(2, len(LLM_PLAN))):
        n = H.label_count(samples)
        loss_sum, egrads = 0.0, {}
        for mb, parts in enumerate(plan):
            part = parts[rank]
            embeds = ranks.leaves([samples[i]["embeds"] for i in part])
            with compute_dtype(torch.device("cpu"), dtype):
                loss_sum += ranks.loss_and_backward(
                    strat, mb, [samples[i]["llm"] for i in part], embeds, 1.0 / n
                )
            egrads.update({i: {k: v.grad.clone() for k, v in e.items()} for i, e in zip(part, embeds)})
        rec["loss_sum"].append(loss_sum)
        rec["embed_grads"].append(egrads)
        H._finish_step(strat, rec)
    rec["gathered"] = _gathered(strat, probe)
    rec["params"] = ranks.full_state(strat)
    rec["lr"] = ranks.current_lr(strat)
    return H.portable(rec)


def encoder_calls(step: int, named: list[tuple[str, Any]]) -> tuple[list[int], int]:
    """Stage 3 in ``ENCODER_PLAN``'s step: (gathers of each tensor, agreement votes) on every
    rank. The toy encoder calls its root once per item; every rank makes as many root calls
    per microbatch as the busiest (placeholders), each module fetched forward and backward
    (the first, fed by data, once per microbatch's backward: ``cost.zero3_uses``), with one
    vote per call and one more per microbatch."""
    from disagg_zero.cost import module_of

    samples = encoder_samples(step)
    plan = ENCODER_PLAN[step]
    calls = [max(sum(len(samples[i]["vision"]["sizes"]) for i in part) for part in mb) for mb in plan]
    first = module_of(named[0][0])
    uses = [sum(calls) + len(calls) if module_of(n) == first else 2 * sum(calls) for n, _ in named]
    return uses, sum(c + 1 for c in calls)


def rank_eval(rank: int, enc_dir: Path, lm_dir: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Forward only, 3 samples over 2 ranks then 1 (rank 1 empty): a frozen
    encoder's outputs and a trained LLM's evaluation sums, under no_grad."""
    enc = H._strategy(rank, 2, "vision", UnusedLayerEncoderFamily(enc_dir), options, optim=None)  # frozen
    llm = H._strategy(rank, 2, "llm", ToyLMFamily(lm_dir), options)
    samples = H.llm_batches(2, 1)[0]
    out: dict[str, Any] = {"encoded": {}, "eval": []}
    with torch.no_grad():
        for mb, parts in enumerate([[[0, 1], [2]], [[3], []]]):
            part = parts[rank]
            images = [i for i in part if "vision" in samples[i]]
            shards = ranks.encode(enc, mb, [samples[i]["vision"] for i in images])
            out["encoded"].update({i: s.value for i, s in zip(images, shards)})
            embeds = [samples[i]["embeds"] for i in part]
            out["eval"].append(ranks.evaluate(llm, [samples[i]["llm"] for i in part], embeds))
    return H.portable(out)


def rank_mismatch(rank: int, enc_dir: Path) -> str:
    """Rank 0 runs one backward more than rank 1 (stage 1 reduces only at the
    boundary, so nothing hangs before): reduce_gradients must say so."""
    fam = UnusedLayerEncoderFamily(enc_dir)
    strat = H._strategy(rank, 2, "vision", fam, {"stage": 1})
    x = encoder_samples(0)[0]
    for mb in range(2 - rank):
        shards = ranks.encode(strat, mb, [x["vision"]])
        ranks.backward(strat, mb, shards, [x["out_grad"]])
    try:
        ranks.reduce_gradients(strat)
    except RuntimeError as exc:
        return str(exc)
    return ""


Z3 = {"zero_optimization": H.PER_LAYER}
CONFIGS = {"1": {"stage": 1}, "2": {"stage": 2}, "3": {"stage": 3, "ds_config": Z3}}


def rank_lora_bytes(rank: int, lm_dir: Path, options: dict[str, Any]) -> dict[str, Any]:
    """The toy LM under LoRA (``qkv`` and ``up``, r 2): its state bytes after one step, and each
    parameter's elements, trained or frozen (what ``cost.zero_state_bytes`` reads)."""
    from disagg.interfaces.lora import LoraSpec
    from disagg.kit.lora import apply_lora

    fam = ToyLMFamily(lm_dir)
    ctx = ranks.rank_context("llm", rank, 1, 2)
    from disagg_zero import ZeroStrategy

    strat = ZeroStrategy(ctx, fam, ZeroStrategy.options_model(**options))
    spec = LoraSpec(r=2, alpha=4, dropout=0.0, targets=("qkv", "up"))
    strat.setup(apply_lora(strat.build_module(), spec, "llm", "test"), H.OPTIM)
    samples = H.llm_batches(2, 1)[0]
    part = H.mine(list(range(len(samples))), rank, 2)
    embeds = ranks.leaves([samples[i]["embeds"] for i in part])
    ranks.loss_and_backward(strat, 0, [samples[i]["llm"] for i in part], embeds, 1.0 / H.label_count(samples))
    ranks.step(strat, ranks.reduce(strat), H.CLIP, zero_grad=False)
    numel = {n: getattr(p, "ds_numel", p.numel()) for n, p in strat.module.named_parameters()}
    grad = {n: p.requires_grad for n, p in strat.module.named_parameters()}
    return {
        "state_bytes": ranks.state_bytes(strat),
        "trained": [numel[n] for n in numel if grad[n]],
        "frozen": [numel[n] for n in numel if not grad[n]],
    }


def rank_all(rank: int, enc_dir: Path, big_enc_dir: Path, lm_dir: Path, mem_lm_dir: Path) -> dict[str, Any]:
    import build_harness
    import zero_recipe_cases

    # first, before the runs below leave freed memory to the allocator for it to reuse
    build = build_harness.rank_build_memory(rank, lm_dir, mem_lm_dir, 2)
    out: dict[str, Any] = {"3-build": H.portable(build)}
    for label, options in CONFIGS.items():
        out[label] = {"encoder": rank_encoder(rank, enc_dir, options), "llm": rank_llm(rank, lm_dir, options)}
    # DeepSpeed's default persistence threshold: the big encoder's large
    # matrices are really partitioned and gathered, the small ones persist
    out["3-big"] = {"encoder": rank_encoder(rank, big_enc_dir, {"stage": 3})}
    out["3-bf16"] = {"llm": rank_llm(rank, lm_dir, CONFIGS["3"], torch.bfloat16)}
    out["3-eval"] = rank_eval(rank, enc_dir, lm_dir, CONFIGS["3"])
    out["1-mismatch"] = rank_mismatch(rank, enc_dir)
    out["lora"] = {s: rank_lora_bytes(rank, lm_dir, CONFIGS[s]) for s in ("1", "3")}
    # last, since it leaves the 2-rank group: test_zero_recipes' runs (in this spawn, not its own)
    out["recipes"] = zero_recipe_cases.zero_recipe_rank(rank, str(lm_dir))
    return out
