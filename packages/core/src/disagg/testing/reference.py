"""The single-process, unpartitioned model: what every strategy must equal.

Runs the families' plain forward on the whole global batch in one process:
loss = sum of label-token losses / label-token count, one backward, global
``clip_grad_norm_`` over every trainable parameter, AdamW per module.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from disagg.interfaces import EncoderFamily, Family, LanguageFamily, OptimSpec
from disagg.kit.roles.optimizer import make_scheduler
from disagg.testing.tolerance import FP32, Precision, assert_exact, assert_params_close, assert_tensors_close


def reference_adamw(params: Iterable[torch.Tensor] | Iterable[dict], optim: OptimSpec) -> torch.optim.AdamW:
    """The single-process optimizer every strategy is held to: AdamW with ``optim``'s
    settings, one tensor at a time (``foreach=False``, what the strategies use on CPU)."""
    return torch.optim.AdamW(
        params, lr=optim.lr, weight_decay=optim.weight_decay, betas=optim.betas, eps=optim.eps, foreach=False
    )


@dataclass
class ReferenceStep:
    loss: float
    grad_norm: float
    grads: dict[str, dict[str, torch.Tensor]]
    params: dict[str, dict[str, torch.Tensor]]


class ReferenceModel:
    """Modules keyed by name ("vision", "audio", "llm"); the LLM last."""

    def __init__(self, families: dict[str, Family], optims: dict[str, OptimSpec | None]):
        self.families = families
        self.modules: dict[str, nn.Module] = {m: f.build(torch.float32) for m, f in families.items()}
        self.optims = optims
        self.optimizers, self.schedulers = {}, {}
        self.steps_taken = 0
        # each parameter's gradient at the first step it got one: what the lr-unit bound of
        # tolerance.assert_params_close is derived from
        self.first_grads: dict[str, dict[str, torch.Tensor]] = {m: {} for m in self.modules}
        for m, mod in self.modules.items():
            spec = optims.get(m)
            if spec is None:
                mod.requires_grad_(False)
                continue
            if spec.frozen or spec.groups:
                # The reference must not reuse the code under test's pattern matching.
                raise ValueError(
                    f"ReferenceModel takes whole-module settings only; freeze parts of {m!r} or give them "
                    "their own param groups on the reference's HF modules directly"
                )
            opt = reference_adamw(mod.parameters(), spec)
            self.optimizers[m] = opt
            self.schedulers[m] = make_scheduler(opt, spec)

    def loss(self, samples: list[dict[str, dict[str, torch.Tensor]]]) -> tuple[torch.Tensor, int]:
        llm_family = self.families["llm"]
        assert isinstance(llm_family, LanguageFamily)
        embeds = []
        for s in samples:
            e = {}
            for m, fam in self.families.items():
                if m != "llm" and m in s:
                    assert isinstance(fam, EncoderFamily)
                    e[m] = fam.encode(self.modules[m], s[m])
            embeds.append(e)
        logits, labels = llm_family.forward(self.modules["llm"], [s["llm"] for s in samples], embeds)
        n = int((labels != -100).sum())
        loss_sum = torch.nn.functional.cross_entropy(
            logits.float(), labels, ignore_index=-100, reduction="sum"
        )
        return loss_sum / n, n

    def step(self, samples: list[dict[str, dict[str, torch.Tensor]]], clip: float | None) -> ReferenceStep:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
        loss, _ = self.loss(samples)
        loss.backward()
        params = [p for m in self.optimizers for p in self.modules[m].parameters()]
        if clip:
            norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        else:
            norm = float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None)))
        grads = {
            m: {
                n: p.grad.detach().clone()
                for n, p in self.modules[m].named_parameters()
                if p.grad is not None
            }
            for m in self.optimizers
        }
        for m, g in grads.items():
            for n, t in g.items():
                self.first_grads[m].setdefault(n, t)
        for m, opt in self.optimizers.items():
            opt.step()
            self.schedulers[m].step()
        self.steps_taken += 1
        state = {
            m: {k: v.detach().clone() for k, v in mod.state_dict().items()} for m, mod in self.modules.items()
        }
        return ReferenceStep(float(loss.detach()), norm, grads, state)

    def assert_params_match(self, module: str, got: dict[str, torch.Tensor], what: str = "") -> float:
        """``got`` (a module's full state dict) equals this reference's current state by the
        tolerance policy: per element in units of the module's learning rate, each element's bound
        from its first reference gradient; a frozen module, or a parameter that never got a
        gradient, must not have moved (``tolerance.assert_params_close``)."""
        spec = self.optims.get(module)
        want = {k: v.detach() for k, v in self.modules[module].state_dict().items()}
        return assert_params_close(
            got,
            want,
            lr=spec.lr if spec is not None else 0.0,  # a schedule only lowers it
            steps=self.steps_taken,
            grads=self.first_grads[module],
            what=what,
            betas=spec.betas if spec is not None else (0.9, 0.999),
            eps=spec.eps if spec is not None else 0.0,
        )


@contextmanager
def capture_first_grads(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Within the block, record each parameter's gradient as the optimizer sees it (after
    clipping) at the first optimizer step it has one, keyed by every name it has (tied weights
    under each). Read-only: a global ``Optimizer`` step pre-hook, so a reference that builds its own
    optimizer is observed, not changed. The ``grads`` of ``tolerance.assert_params_close``."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    out: dict[str, torch.Tensor] = {}

    def hook(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) in names:
                    for n in names[id(p)]:
                        out.setdefault(n, p.grad.detach().clone())

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(hook)
    try:
        yield out
    finally:
        handle.remove()


def assert_close_dicts(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    rtol: float = 1e-5,
    atol: float | None = None,
    what: str = "",
) -> None:
    """Kept for callers of the old helper; delegates to :mod:`disagg.testing.tolerance`.

    ``rtol=0, atol=0`` is :func:`~disagg.testing.tolerance.assert_exact`; otherwise every tensor is
    compared per element against its own scale (``tolerance.assert_tensors_close``). New checks call
    the policy directly, and parameters after AdamW steps use ``assert_params_close`` (lr units).
    """
    if rtol == 0 and atol == 0:
        assert_exact(got, want, what)
        return
    if atol is not None:
        raise ValueError("assert_close_dicts: an absolute tolerance is not part of the policy (tolerance.py)")
    assert_tensors_close(got, want, what, Precision("fp32", rtol=rtol, param_unit=FP32.param_unit))
