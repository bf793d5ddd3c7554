"""Rank functions of ``test_flops_measured`` (spawned ranks import them by module name): one
step of each strategy on the tiny Qwen2.5-VL, the rank's FLOPs counted by PyTorch's
``torch.utils.flop_counter.FlopCounterMode`` while it runs."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from disagg.testing import ranks

FAMILY = "qwen2_5_vl"
#: (strategy, module, degree, replicas, options): each first-party strategy on a 2-rank group
CASES: list[tuple[str, str, int, int, dict[str, Any]]] = [
    ("ddp", "vision", 1, 2, {}),
    ("ulysses", "vision", 2, 1, {}),
    ("zero", "vision", 1, 2, {"stage": 3}),
    ("ddp", "llm", 1, 2, {}),
    ("megatron_tp", "llm", 2, 1, {}),
    ("zero", "llm", 1, 2, {"stage": 3}),
]
#: image sizes (pixels): 4x4 and 8x6 merged tokens after Qwen2.5-VL's 28-pixel units
IMAGES = [(112, 112), (224, 168)]


def vision_inputs(path: str) -> list[dict[str, torch.Tensor]]:
    """One single-image sample per entry of :data:`IMAGES`."""
    from disagg.plugins import get_registry
    from disagg_vision_sp.testing import random_images

    family = get_registry().family("encoder", FAMILY)(path, {})
    return [family.preprocess([img]) for img in random_images(IMAGES, seed=3)]


def llm_inputs(path: str) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """Two samples: text only (37 tokens) and one with 16 image rows (61 tokens)."""
    from disagg.plugins import get_registry

    family = get_registry().family("llm", FAMILY)(path, {})
    g = torch.Generator().manual_seed(0)
    pid = family.placeholder_token_id("vision")
    vocab, hidden = family.text_config.vocab_size, family.text_config.hidden_size
    samples, embeds = [], []
    for n_text, n_img in ((37, 0), (45, 16)):
        text = torch.randint(20, vocab, (n_text,), generator=g)
        ids = torch.cat([text[:3], torch.full((n_img,), pid), text[3:]])
        labels = ids.clone()
        labels[: 3 + n_img] = -100
        s = {"input_ids": ids, "labels": labels}
        e: dict[str, torch.Tensor] = {}
        if n_img:
            e["vision"] = torch.randn(n_img, hidden, generator=g)
            s.update(family.extra_inputs({"vision": {"image_grid_thw": torch.tensor([[1, 8, 8]])}}))
        samples.append(s)
        embeds.append(e)
    return samples, embeds


def count_cpu_attention() -> None:
    """Teach FlopCounterMode the CPU SDPA kernel (torch 2.13 has formulas for the CUDA flash,
    efficient and cudnn kernels only, so CPU attention counted 0): PyTorch's own SDPA formulas,
    which count every query-key pair (a causal kernel as a full one)."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    fwd, bwd = (
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
    )
    if fwd not in fc.flop_registry:

        @fc.register_flop_formula(fwd)
        def _fwd(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kw: Any) -> int:
            return fc.sdpa_flop_count(query, key, value)

    if bwd not in fc.flop_registry:

        @fc.register_flop_formula(bwd)
        def _bwd(
            grad: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kw: Any
        ) -> int:
            return fc.sdpa_backward_flop_count(grad, query, key, value)


def _counted(fn: Any) -> dict[str, float]:
    """FLOPs of ``fn()`` by aten op, as FlopCounterMode counts them (forward and backward)."""
    count_cpu_attention()
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return {str(op): float(n) for op, n in counter.get_flop_counts()["Global"].items()}


def _case(reg: Any, path: str, rank: int, world: int, case: tuple, images: list, llm: tuple) -> dict:
    name, module, degree, replicas, options = case
    family = reg.family("llm" if module == "llm" else "encoder", FAMILY)(path, {})
    ctx = ranks.rank_context(module, rank, degree, replicas)
    strat = ranks.strategy_rank(reg.strategies[name], family, ctx, options=options)
    mine = [rank] if replicas == world else list(range(len(images)))  # replicas: a sample each
    if module == "llm":
        samples, embeds = llm

        def fn() -> None:
            ranks.loss_and_backward(
                strat, 0, [samples[i] for i in mine], ranks.leaves([embeds[i] for i in mine]), 1.0
            )

    else:

        def fn() -> None:
            shards = ranks.encode(strat, 0, [images[i] for i in mine])
            ranks.backward(strat, 0, shards, [torch.ones_like(s.value) for s in shards])

    by_op = _counted(fn)
    ranks.reduce_gradients(strat)  # every rank makes the group's collectives
    return {"case": (name, module, degree, replicas), "samples": mine, "by_op": by_op}


def rank_flops(rank: int, path: str, world: int = 2) -> list[dict[str, Any]]:
    """Per case of :data:`CASES`, this rank's counted FLOPs by op and the samples it ran."""
    from disagg.plugins import get_registry

    reg = get_registry()
    images, llm = vision_inputs(path), llm_inputs(path)
    return [_case(reg, path, rank, world, case, images, llm) for case in CASES]
