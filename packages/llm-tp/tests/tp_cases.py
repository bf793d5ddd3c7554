"""Shared pieces of the equivalence tests: a batch with fake encoder rows, the
single-process Hugging Face reference, and the per-rank megatron_tp run.

Rank functions live here (not in a test module) so spawned ranks can import them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from disagg.interfaces import OptimSpec
from disagg.kit.recompute.activations import saved_bytes_hooks
from disagg.testing import ranks
from disagg.testing.ranks import dumps, loads
from disagg.testing.reference import reference_adamw

MAX_NORM = 0.05  # small enough that clipping is active in every step
LR = 1e-3


@dataclass
class Case:
    family: str
    path: str
    degree: int
    replicas: int = 1
    steps: int = 3
    sequence_parallel: bool = False
    samples: list[dict[str, torch.Tensor]] = field(default_factory=list)
    embeds: list[dict[str, torch.Tensor]] = field(default_factory=list)


def family_cls(name: str):
    from disagg_llm_tp.families.llama import LlamaFamily
    from disagg_llm_tp.families.qwen2 import Qwen2Family
    from disagg_llm_tp.families.qwen2_5_vl import Qwen25VLLanguageFamily
    from disagg_llm_tp.families.qwen2_vl import Qwen2VLLanguageFamily
    from disagg_llm_tp.families.qwen3_vl import Qwen3VLLanguageFamily

    return {
        "qwen2": Qwen2Family,
        "llama": LlamaFamily,
        "qwen2_5_vl": Qwen25VLLanguageFamily,
        "qwen2_vl": Qwen2VLLanguageFamily,
        "qwen3_vl": Qwen3VLLanguageFamily,
    }[name]


def make_batch(family, n_samples: int = 4, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Ragged samples with 0, 2 or 4 image placeholders and fixed random encoder rows."""
    g = torch.Generator().manual_seed(seed)
    pid = family.placeholder_token_id("vision")
    vocab = family.text_config.vocab_size
    # qwen3_vl's image rows carry its DeepStack features as extra columns
    hidden = family.text_config.hidden_size * (1 + getattr(family, "deepstack_layers", lambda: 0)())
    samples, embeds = [], []
    for i in range(n_samples):
        n_img = (0, 4, 2, 4)[i % 4]
        # Real-text ids stay away from the special tokens (low ids); some ids may
        # lie beyond the tokenizer, exercising the whole (padded) vocabulary.
        text = torch.randint(20, vocab, (7 + 3 * i,), generator=g)
        ids = torch.cat([text[:3], torch.full((n_img,), pid), text[3:]])
        labels = ids.clone()
        labels[: 3 + n_img] = -100
        s = {"input_ids": ids, "labels": labels}
        e = {}
        if n_img:
            e["vision"] = torch.randn(n_img, hidden, generator=g)
            s.update(family.extra_inputs({"vision": {"image_grid_thw": torch.tensor([[1, 2, n_img * 2]])}}))
        samples.append(s)
        embeds.append(e)
    return samples, embeds


def replica_slice(items: list, replica: int, replicas: int) -> list:
    per = len(items) // replicas
    return items[replica * per : (replica + 1) * per]


def label_count(samples: list[dict]) -> int:
    return sum(int((s["labels"][1:] != -100).sum()) for s in samples)


# -- reference: one process, unpartitioned HF model -------------------------------------------------------
def reference(case: Case) -> dict:
    fam = family_cls(case.family)(case.path)
    torch.manual_seed(0)
    model = _hf_model(case)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    all_params = {n: p for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    opt = reference_adamw(params.values(), OptimSpec(lr=LR))
    total = label_count(case.samples)
    out: dict = {}
    for step in range(case.steps):
        leaves = [{k: v.clone().requires_grad_(True) for k, v in e.items()} for e in case.embeds]
        loss_sum = torch.zeros(())
        logits_all = []
        for s, e in zip(case.samples, leaves):
            logits = _hf_logits(case, fam, model, s, e)[0]
            logits_all.append(logits[:-1])
            loss_sum = loss_sum + torch.nn.functional.cross_entropy(
                logits[:-1], s["labels"][1:], ignore_index=-100, reduction="sum"
            )
        (loss_sum / total).backward()
        if step == 0:
            out["loss"] = float(loss_sum.detach())
            out["logits"] = torch.cat(logits_all).detach()
            out["grads"] = {n: p.grad.detach().clone() for n, p in params.items()}
            # under every name of a tied weight: the parameter check's lr-unit bound reads it
            out["param_grads"] = {n: p.grad.detach().clone() for n, p in all_params.items()}
            out["embed_grads"] = [{k: v.grad.clone() for k, v in e.items()} for e in leaves]
        torch.nn.utils.clip_grad_norm_(list(params.values()), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = {n: p.detach().clone() for n, p in all_params.items()}  # tied weights under each name
    return out


#: families whose dir is a whole Qwen VLM (the reference is its ForConditionalGeneration)
QWEN_VL = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl")


def _hf_model(case: Case):
    from transformers import AutoModelForCausalLM

    if case.family in QWEN_VL:
        model_cls = family_cls(case.family).hf_classes()[1]
        model = model_cls.from_pretrained(case.path, dtype=torch.float32)
        model.model.visual.requires_grad_(False)  # the vision group's parameters, not the LLM's
        return model
    return AutoModelForCausalLM.from_pretrained(case.path, dtype=torch.float32)


def _hf_logits(case: Case, fam, model, s: dict, e: dict) -> torch.Tensor:
    ids = s["input_ids"][None]
    if case.family in QWEN_VL:
        # HF's own multimodal path: encoder outputs handed in, mRoPE from image_grid_thw.
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        cfg = model.config
        kw = {"mm_token_type_ids": (ids == cfg.image_token_id).int()}
        if e and case.family == "qwen3_vl":
            # the rows' extra columns are the DeepStack features, handed to HF as its encoder returns them
            from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

            width = cfg.text_config.hidden_size
            blocks = list(e["vision"].split(width, dim=-1))
            kw["image_grid_thw"] = s["image_grid_thw"]
            kw["mm_encoder_outputs"] = {
                "image": BaseModelOutputWithDeepstackFeatures(
                    pooler_output=[blocks[0]], deepstack_features=[[b] for b in blocks[1:]]
                )
            }
        elif e:
            kw["image_grid_thw"] = s["image_grid_thw"]
            kw["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=[e["vision"]])}
        model.model.rope_deltas = None
        return model(input_ids=ids, use_cache=False, **kw).logits
    x = model.get_input_embeddings()(ids)[0]
    if e:
        where = (s["input_ids"] == fam.placeholder_token_id("vision")).nonzero().squeeze(1)
        x = x.index_put((where,), e["vision"])
    return model(inputs_embeds=x[None], use_cache=False).logits


# -- the megatron_tp run: one call per rank ------------------------------------------------------------
def tp_rank_many(rank: int, cases_bytes: list[bytes]) -> bytes:
    """Several cases one after another on the same ranks: one spawn, one import of Megatron
    (the strategy re-initializes Megatron's groups when the degree changes). Each case starts
    from a fresh process's RNG state; a case that raises names itself. Tensors cross the process
    boundary as bytes (``disagg.testing.ranks.dumps``)."""
    outs = []
    for i, raw in enumerate(cases_bytes):
        case = loads(raw)
        torch.manual_seed(torch.initial_seed())
        try:
            outs.append(_tp_rank(rank, case))
        except Exception as e:
            sp = case.sequence_parallel
            e.add_note(f"in case {i}: {case.family}, degree {case.degree} x {case.replicas}, sp {sp}")
            raise
    return dumps(outs)


def run_tp_many(cases: dict[Any, Case], timeout: float = 1500) -> dict[Any, list[dict]]:
    """Each case's megatron_tp run, one spawn per world size (name -> each rank's output);
    ``timeout``: seconds a spawn may take."""
    from disagg.testing.dist import run_ranks

    by_world: dict[int, list[Any]] = {}
    for name, case in cases.items():
        by_world.setdefault(case.degree * case.replicas, []).append(name)
    out: dict[Any, list[dict]] = {}
    for world, names in by_world.items():
        per_rank = [
            loads(b)
            for b in run_ranks(tp_rank_many, world, [dumps(cases[n]) for n in names], timeout=timeout)
        ]
        for i, name in enumerate(names):
            out[name] = [rank_outs[i] for rank_outs in per_rank]
    return out


def run_tp(case: Case) -> list[dict]:
    """One case's megatron_tp run: each rank's output."""
    return run_tp_many({0: case}, timeout=600)[0]


def _tp_rank(rank: int, case: Case) -> dict:
    from disagg_llm_tp.strategy import MegatronTPOptions, MegatronTPStrategy

    ctx = ranks.rank_context("llm", rank, case.degree, case.replicas)
    fam = family_cls(case.family)(case.path)
    options = MegatronTPOptions(sequence_parallel=case.sequence_parallel)
    strat = ranks.strategy_rank(MegatronTPStrategy, fam, ctx, options=options, optim=OptimSpec(lr=LR))
    samples = replica_slice(case.samples, ctx.replica, case.replicas)
    embeds = replica_slice(case.embeds, ctx.replica, case.replicas)
    total = label_count(case.samples)
    out: dict = {"rank": rank}
    with torch.no_grad():
        out["eval"] = ranks.evaluate(strat, samples, embeds)
    for step in range(case.steps):
        leaves = ranks.leaves(embeds)
        if step == 0:
            with torch.no_grad():
                logits, _ = fam.forward(strat.module, samples, leaves)
                n = max(len(x["input_ids"]) for x in samples)
                real = torch.cat([torch.arange(n - 1) < len(x["input_ids"]) - 1 for x in samples])
                out["logits"] = _gather_vocab(logits, strat)[real]
        saved: list[int] = []
        with saved_bytes_hooks(strat.module, saved.append):  # as the worker's activation metric
            loss = ranks.loss_and_backward(strat, 0, samples, leaves, 1.0 / total)
        norm_sq = ranks.reduce(strat)
        if step == 0:
            out["loss"] = loss
            out["norm_sq"] = norm_sq
            out["activation_bytes"] = sum(saved)
            out["grads"] = ranks.full_grads(strat)
            out["embed_grads"] = [{k: v.grad.clone() for k, v in e.items()} for e in leaves]
        ranks.step(strat, norm_sq, MAX_NORM)
    with torch.no_grad():  # the trained model's loss on its samples, for the export test
        logits, labels = fam.forward(strat.module, samples, embeds)
        out["final_loss"] = float(ranks.loss_sum(strat, logits, labels))
    out["params"] = ranks.full_state(strat)
    out["comm_bytes"] = ctx.comm.total()
    out["collectives"] = dict(ctx.comm.bytes_by_op)
    return out


def _gather_vocab(logits: torch.Tensor, strat) -> torch.Tensor:
    pieces = [torch.empty_like(logits) for _ in range(strat.ctx.degree)]
    dist.all_gather(pieces, logits.contiguous(), group=strat.tp_group)
    return torch.cat(pieces, dim=-1)[:, : strat.plan.output_vocab]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
