"""The single-process Hugging Face LLaVA vision path run under core's bf16 rule, the
reference of the ulysses bf16 test: fp32 parameters, gradients and AdamW state, the
forward under ``compute_dtype(cpu, bf16)`` and the backward outside it (as core runs
an encoder), one step.

Bounds come from the tolerance policy (``disagg.testing.tolerance``): outputs and
gradients per element within ``BF16.rtol`` (8 bf16 epsilons) of each tensor's own
scale; parameters after the step in units of the learning rate, the gradient's bf16
resolution carried through Adam, stored in fp32 (the master weights): :data:`BF16_COMPUTE`.
"""

from __future__ import annotations

import torch

from disagg.interfaces import OptimSpec, compute_dtype
from disagg.testing.tolerance import BF16_COMPUTE, reference_precisions  # noqa: F401 (re-exported)

OPTIM = OptimSpec(lr=1e-3)  # what ulysses_cases._strategy sets the ranks up with


def hf_bf16_step(path: str, inputs: list[dict], grads: list[torch.Tensor]) -> dict:
    """``LlavaModel.get_image_features`` (HF's own: vision tower, feature layer,
    projector) of every sample, eager attention and eval mode as the ranks run; its
    gradients also in fp32, for :func:`reference_precisions`."""
    from transformers import LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model = hf.model.eval()
    cfg = hf.config
    params = {
        f"{part}.{n}": p
        for part in ("vision_tower", "multi_modal_projector")
        for n, p in getattr(model, part).named_parameters()
    }
    initial = {n: p.detach().clone() for n, p in params.items()}
    opt = torch.optim.AdamW(
        params.values(), lr=OPTIM.lr, weight_decay=OPTIM.weight_decay, betas=OPTIM.betas, eps=OPTIM.eps
    )

    def forward_backward(dtype: torch.dtype) -> list[torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        outs = []
        with compute_dtype(torch.device("cpu"), dtype):
            for x in inputs:
                feats = model.get_image_features(
                    x["pixel_values"],
                    vision_feature_layer=cfg.vision_feature_layer,
                    vision_feature_select_strategy=cfg.vision_feature_select_strategy,
                    output_hidden_states=True,
                ).pooler_output
                outs.append(torch.cat(list(feats)).reshape(-1, cfg.text_config.hidden_size))
        torch.autograd.backward(outs, [g.to(o.dtype) for o, g in zip(outs, grads)])  # outside autocast
        return [o.detach() for o in outs]

    forward_backward(torch.float32)
    g32 = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
    outs = forward_backward(torch.bfloat16)
    got = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
    opt.step()
    return {
        "outs": outs,
        "grads": got,
        "precisions": reference_precisions(got, g32),
        "initial": initial,
        "params": {n: p.detach().clone() for n, p in params.items()},
    }
