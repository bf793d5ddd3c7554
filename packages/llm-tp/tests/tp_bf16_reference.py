"""The single-process Hugging Face model run under core's bf16 rule, the reference
of the bf16 tests: fp32 parameters, gradients and AdamW state, the forward (and
the LLM's backward, as the rank runs it) under ``compute_dtype(cpu, bf16)``.

Bounds come from the tolerance policy (``disagg.testing.tolerance``): computed
values (loss, gradients) per element within ``BF16.rtol`` (8 bf16 epsilons) of
each tensor's own scale; parameters after the step in units of the learning
rate, the gradient's bf16 resolution carried through Adam, stored in fp32 (the
master weights): :data:`BF16_COMPUTE`.
"""

from __future__ import annotations

import torch

from disagg.interfaces import OptimSpec, compute_dtype
from disagg.testing.tolerance import BF16, FP32, Precision

#: bf16 arithmetic, fp32 master weights: gradients resolved to bf16's bound, parameters
#: stored (and so rounded) in fp32
BF16_COMPUTE = Precision("bf16 compute, fp32 master weights", rtol=BF16.rtol, param_unit=FP32.param_unit)
OPTIM = OptimSpec(lr=1e-3)  # what the ranks' strategies are set up with (dropout_cases._strategy)


def reference_precisions(g16: dict[str, torch.Tensor], g32: dict[str, torch.Tensor]) -> dict[str, Precision]:
    """Per gradient tensor: the policy's bf16 bound, unless the reference's own bf16
    gradient is further than that from the same reference's fp32 gradient (a tensor that
    is zero in exact arithmetic, where only rounding is left: a key bias, which softmax
    ignores), in which case twice that error, relative to the tensor's own largest element:
    no honest bf16 run can be asked to be closer to the reference than the reference is
    to itself. Decided from the reference alone, per tensor, never by name."""
    out = {}
    for n, g in g16.items():
        scale = float(g.abs().max())
        err = float((g.double() - g32[n].double()).abs().max())
        rtol = max(BF16.rtol, 2 * err / scale) if scale > 0 else BF16.rtol
        name = BF16_COMPUTE.name if rtol == BF16.rtol else f"bf16 at the reference's own error ({err:.1e})"
        out[n] = Precision(name, rtol=rtol, param_unit=FP32.param_unit)
    return out


def hf_bf16_step(path: str, samples: list[dict], embeds: list[dict], placeholder: int) -> dict:
    """One step of the HF causal LM from ``path`` (eager attention, eval mode: the ranks'
    settings), each sample on its own, encoder rows at the placeholder tokens; its
    gradients also in fp32, for :func:`reference_precisions`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    params = dict(model.named_parameters())
    # by state-dict name: a tied weight (lm_head = embed_tokens) under each of its names, as the ranks save it
    named = {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.nn.Parameter)}
    initial = {n: p.detach().clone() for n, p in named.items()}
    opt = torch.optim.AdamW(
        params.values(), lr=OPTIM.lr, weight_decay=OPTIM.weight_decay, betas=OPTIM.betas, eps=OPTIM.eps
    )
    total = sum(int((s["labels"][1:] != -100).sum()) for s in samples)

    def forward_backward(dtype: torch.dtype) -> tuple[float, list[dict]]:
        opt.zero_grad(set_to_none=True)
        leaves = [{k: v.clone().requires_grad_(True) for k, v in e.items()} for e in embeds]
        loss_sum = 0.0
        with compute_dtype(torch.device("cpu"), dtype):
            for s, e in zip(samples, leaves):
                x = model.get_input_embeddings()(s["input_ids"][None])[0]
                if e:
                    where = (s["input_ids"] == placeholder).nonzero().squeeze(1)
                    x = x.index_put((where,), e["vision"].to(x.dtype))
                logits = model(inputs_embeds=x[None], use_cache=False).logits[0, :-1]
                loss = torch.nn.functional.cross_entropy(
                    logits.float(), s["labels"][1:], ignore_index=-100, reduction="sum"
                )
                (loss / total).backward()
                loss_sum += float(loss.detach())
        return loss_sum, leaves

    forward_backward(torch.float32)
    g32 = {n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None}
    loss_sum, leaves = forward_backward(torch.bfloat16)
    grads = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
    by_state_name = {n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None}
    opt.step()
    return {
        "loss": loss_sum,
        "grads": grads,
        "grads_by_state_name": by_state_name,
        "precisions": reference_precisions(by_state_name, g32),
        "embed_grads": [{k: v.grad.clone() for k, v in e.items()} for e in leaves],
        "initial": initial,
        "params": {n: p.detach().clone() for n, p in named.items()},
    }
