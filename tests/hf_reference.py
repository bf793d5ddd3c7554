"""The single-process Hugging Face model trained on the same global batches as
a disagg run: the correctness contract's reference, at every step.

One AdamW over every parameter of the whole HF model (per-module optimizers
with the same settings are the same thing: AdamW is per parameter), the loss
summed over label tokens and divided by the global label count, one backward
per step, ``clip_grad_norm_`` over every parameter. Nothing is bent toward
the code under test: a parameter without a gradient keeps ``grad = None``
and AdamW skips it, as it does in any HF training script.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import ray
import torch


@dataclass
class ReferenceRun:
    losses: list[float]
    grad_norms: list[float]
    state: dict[str, torch.Tensor]
    #: after each step, the loss over ``eval_set`` in eval mode (empty without one)
    eval_losses: list[float] = field(default_factory=list)
    #: the state after each step (``states[-1]`` is ``state``)
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)
    #: each step's gradients (before clipping), by state-dict name (a tied weight under
    #: each of its names), of the parameters that got one
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)


def batches_of(cfg: Any, steps: int) -> list[list[dict[str, dict[str, torch.Tensor]]]]:
    """The run's global batches, read back from the object store (same order)."""
    from disagg.data import build_data_source
    from disagg.plugins import get_registry
    from disagg.runtime.plan import families_for

    source = build_data_source(cfg, families_for(cfg, get_registry()))
    out = []
    for _, batch in zip(range(steps), source.batches(0)):
        out.append([{m: ray.get(ref) for m, ref in s.inputs.items()} for s in batch])
    return out


def eval_set_of(cfg: Any) -> list[dict[str, dict[str, torch.Tensor]]]:
    """The run's eval set (``data.eval``), every usable sample in file order."""
    from disagg.data import build_data_source
    from disagg.plugins import get_registry
    from disagg.runtime.plan import families_for

    source = build_data_source(cfg, families_for(cfg, get_registry()), split="eval")
    return [{m: ray.get(ref) for m, ref in s.inputs.items()} for s in source.samples()]


def eval_loss(
    model: torch.nn.Module,
    samples: list[dict[str, dict[str, torch.Tensor]]],
    forward_kwargs: Callable[[dict[str, dict[str, torch.Tensor]]], dict[str, torch.Tensor]],
) -> float:
    """The HF model's loss over ``samples`` in eval mode: the sum over every
    label token divided by their count (one sample at a time, no padding)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            total = sum(int((s["llm"]["labels"][1:] != -100).sum()) for s in samples)
            loss_sum = 0.0
            for s in samples:
                n = int((s["llm"]["labels"][1:] != -100).sum())
                loss_sum += float(model(**forward_kwargs(s)).loss) * n
    finally:
        model.train(was_training)
    return loss_sum / total


def train_reference(
    model: torch.nn.Module,
    batches: list[list[dict[str, dict[str, torch.Tensor]]]],
    forward_kwargs: Callable[[dict[str, dict[str, torch.Tensor]]], dict[str, torch.Tensor]],
    train: Any,
    param_groups: Callable[[torch.nn.Module], list[dict[str, Any]]] | None = None,
    eval_set: list[dict[str, dict[str, torch.Tensor]]] | None = None,
) -> ReferenceRun:
    """``forward_kwargs(sample)``: the HF model's keyword arguments for one sample.
    ``param_groups(model)``: AdamW param groups picked from the HF model's own
    submodules (per-part learning rates), default one group of every parameter.
    A test freezes parts with ``requires_grad_(False)`` on the HF submodules: they
    get no gradient, so AdamW and ``clip_grad_norm_`` skip them. With ``eval_set``,
    the eval loss after every step (``train.eval_every: 1``)."""
    model.train()
    opt = torch.optim.AdamW(
        param_groups(model) if param_groups else model.parameters(),
        lr=train.lr,
        weight_decay=train.weight_decay,
        betas=tuple(train.betas),
        eps=train.eps,
        foreach=False,
    )
    losses, norms, evals, states, grads = [], [], [], [], []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        total = sum(int((s["llm"]["labels"][1:] != -100).sum()) for s in batch)
        loss_sum = 0.0
        for s in batch:  # one sample at a time: no padding, exactly the HF forward
            n = int((s["llm"]["labels"][1:] != -100).sum())
            out = model(**forward_kwargs(s))
            (out.loss * n / total).backward()
            loss_sum += float(out.loss.detach()) * n
        params = [p for p in model.parameters() if p.grad is not None]
        grads.append(
            {
                k: v.grad.detach().clone()
                for k, v in model.state_dict(keep_vars=True).items()
                if isinstance(v, torch.nn.Parameter) and v.grad is not None
            }
        )
        if train.clip_grad_norm:
            norm = float(torch.nn.utils.clip_grad_norm_(params, train.clip_grad_norm))
        else:
            norm = float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params)))
        opt.step()
        losses.append(loss_sum / total)
        norms.append(norm)
        if eval_set:
            evals.append(eval_loss(model, eval_set, forward_kwargs))
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return ReferenceRun(losses, norms, states[-1], evals, states, grads)


def qwen2_5_vl_kwargs(image_token_id: int) -> Callable[[dict[str, dict[str, torch.Tensor]]], dict[str, Any]]:
    """``Qwen2_5_VLForConditionalGeneration``'s keyword arguments for one sample,
    as its processor hands them over (``mm_token_type_ids`` places mRoPE's image rows)."""

    def kwargs(s: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
        llm = s["llm"]
        kw: dict[str, Any] = {"input_ids": llm["input_ids"][None], "labels": llm["labels"][None]}
        if "vision" in s:
            kw.update(
                pixel_values=s["vision"]["pixel_values"],
                image_grid_thw=s["vision"]["image_grid_thw"],
                mm_token_type_ids=(llm["input_ids"][None] == image_token_id).int(),
            )
        return kw

    return kwargs


def pixel_values_kwargs(s: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The keyword arguments for one sample of a model that takes ``pixel_values`` alone (LLaVA,
    InternVL): its processor's ``input_ids`` and ``pixel_values``, and the labels."""
    kw = {"input_ids": s["llm"]["input_ids"][None], "labels": s["llm"]["labels"][None]}
    if "vision" in s:
        kw["pixel_values"] = s["vision"]["pixel_values"]
    return kw


def assert_run_matches(
    run_dir: Path,
    reference: ReferenceRun,
    state_after: Callable[[int], dict[str, torch.Tensor]],
    train: Any,
    what: str = "",
) -> list[float]:
    """A run's logged loss and grad norm of every step, and ``state_after(step)`` (its
    weights after each step, named as ``reference.states``), against the reference,
    through the tolerance policy: scalars relative to their size, parameters in
    units of the learning rate per element (``disagg.testing.tolerance``). Returns
    the run's losses."""
    from disagg.testing.tolerance import assert_params_close, assert_scalar_close, first_grads

    losses, norms = run_metrics(run_dir)
    assert len(losses) == len(norms) == len(reference.losses), (len(losses), len(reference.losses))
    for step, (lo, no, want_lo, want_no) in enumerate(
        zip(losses, norms, reference.losses, reference.grad_norms), start=1
    ):
        assert_scalar_close(lo, want_lo, f"{what}loss of step {step}")
        assert_scalar_close(no, want_no, f"{what}grad norm of step {step}")
    for step, want in enumerate(reference.states, start=1):
        assert_params_close(
            state_after(step),
            want,
            lr=train.lr,
            steps=step,
            grads=first_grads(reference.grads[:step]),
            what=f"{what}after step {step}: ",
            betas=tuple(train.betas),
        )
    return losses


def assert_run_matches_reference(
    run_dir: Path,
    reference: ReferenceRun,
    train: Any,
    model_cls: type,
    what: str,
    *,
    grads: Mapping[str, torch.Tensor] | None = None,
    lr: float | None = None,
    first: int = 1,
) -> dict[str, torch.Tensor]:
    """The end-to-end tests' closing check: the run's logged loss and grad norm of every step
    against the reference's (relative to their size), and its eval loss after every step where
    the reference evaluated (``eval_set``), then the run's last checkpoint through ``disagg
    export`` and ``model_cls.from_pretrained`` against the reference's final parameters, every
    one of them (the same names), in units of the learning rate per element
    (``disagg.testing.tolerance``). ``what`` names the case in every message; returns the
    exported state.

    ``grads``: the first gradients the parameter bound is derived from; by default the
    reference's own, taken before clipping (``first_grads(reference.grads)``). With ``eps > 0``
    and a clipped step, the gradients AdamW saw (``capture_first_grads`` around
    ``train_reference``, after clipping) give a tighter bound: pass them where captured.
    ``lr``: the largest learning rate of any parameter group (default ``train.lr``).
    ``first``: a resumed run logs steps ``first ..`` only; its last checkpoint is still the
    reference's last step."""
    from disagg.testing.tolerance import assert_params_close, assert_scalar_close, first_grads

    steps = len(reference.losses)
    want = range(first, steps + 1)
    losses, norms = run_metrics(run_dir)
    assert len(losses) == len(norms) == len(want), (what, len(losses), len(norms), list(want))
    for i, step in enumerate(want):
        assert_scalar_close(losses[i], reference.losses[step - 1], f"{what} step {step} loss")
        assert_scalar_close(norms[i], reference.grad_norms[step - 1], f"{what} step {step} grad norm")
    if reference.eval_losses:  # evaluated after every step, in eval mode over the whole eval set
        evals = run_eval_losses(run_dir)
        assert len(evals) == len(want), (what, len(evals), list(want))
        for i, step in enumerate(want):
            assert_scalar_close(
                evals[i], reference.eval_losses[step - 1], f"{what} eval loss after step {step}"
            )
    got = exported_state(run_dir, steps, Path(run_dir).parent / f"{Path(run_dir).name}-export", model_cls)
    assert set(got) == set(reference.state), (what, set(got) ^ set(reference.state))
    assert_params_close(
        got,
        reference.state,
        lr=train.lr if lr is None else lr,
        steps=steps,
        grads=first_grads(reference.grads) if grads is None else grads,
        what=f"{what} after {steps} steps: ",
        betas=tuple(train.betas),
        eps=train.eps,
    )
    return got


def run_metrics(run_dir: Path) -> tuple[list[float], list[float]]:
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


def run_eval_losses(run_dir: Path) -> list[float]:
    """``eval_loss`` of every step that evaluated."""
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_loss"] for r in rows if "eval_loss" in r]


def exported_state(run_dir: Path, step: int, out: Path, model_cls: type) -> dict[str, torch.Tensor]:
    """The run's final checkpoint through ``disagg export``, loaded back with
    ``from_pretrained`` as a user would."""
    from disagg.plugins import get_registry
    from disagg.runtime.export import export_checkpoint

    (dest,) = export_checkpoint(Path(run_dir) / "checkpoints" / f"step-{step}", out, get_registry())
    model = model_cls.from_pretrained(str(dest), dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}
