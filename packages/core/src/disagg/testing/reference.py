"""The single-process, unpartitioned model: what every strategy must equal.

Runs the families' plain forward on the whole global batch in one process:
loss = sum of label-token losses / label-token count, one backward, global
``clip_grad_norm_`` over every trainable parameter, AdamW per module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from disagg.interfaces import EncoderFamily, Family, LanguageFamily, OptimSpec
from disagg.interfaces.strategy import make_scheduler
from disagg.testing.tolerance import FP32, Precision, assert_exact, assert_tensors_close


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
        self.optimizers, self.schedulers = {}, {}
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
            opt = torch.optim.AdamW(
                mod.parameters(),
                lr=spec.lr,
                weight_decay=spec.weight_decay,
                betas=spec.betas,
                eps=spec.eps,
                foreach=False,
            )
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
        for m, opt in self.optimizers.items():
            opt.step()
            self.schedulers[m].step()
        state = {
            m: {k: v.detach().clone() for k, v in mod.state_dict().items()} for m, mod in self.modules.items()
        }
        return ReferenceStep(float(loss.detach()), norm, grads, state)


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
