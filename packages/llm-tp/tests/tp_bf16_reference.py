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
from dropout_cases import BF16_OPTIM as OPTIM  # noqa: E402 (what the ranks' strategies are set up with)

from disagg.interfaces import compute_dtype
from disagg.testing.tolerance import BF16_COMPUTE, reference_precisions  # noqa: F401 (re-exported)


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
