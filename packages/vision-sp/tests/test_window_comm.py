"""Qwen2.5-VL window attention under ``ulysses``: only full-attention blocks communicate."""

from __future__ import annotations

from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision
from disagg_vision_sp.testing import random_images, run_ulysses, upstream_grads
from disagg_vision_sp.ulysses.layout import plan_bounds

SAMPLES = [[(64, 40), (16, 16)], [(40, 24)]]


def analytic_all_to_all_bytes(
    n_local: int, n_total: int, degree: int, heads: int, head_dim: int, full_layers: int, elem: int = 4
) -> int:
    """Bytes one rank sends per step: per full-attention block, forward q/k/v
    (its tokens, other shards' heads) and output (other shards' tokens, its
    heads), then the same two exchanges reversed in backward."""
    hl = heads // degree
    qkv_fwd = (degree - 1) * n_local * 3 * hl * head_dim
    out_fwd = (n_total - n_local) * hl * head_dim
    qkv_bwd = (n_total - n_local) * 3 * hl * head_dim
    out_bwd = (degree - 1) * n_local * hl * head_dim
    return full_layers * elem * (qkv_fwd + out_fwd + qkv_bwd + out_bwd)


def test_only_full_attention_blocks_communicate(tiny_qwen):
    family = Qwen2_5_VLVision(tiny_qwen)
    cfg = family.vision_config()
    inputs = [family.preprocess(random_images(s, seed=i)) for i, s in enumerate(SAMPLES)]
    layout = family.ulysses_layout(inputs)
    degree = 2
    bounds = plan_bounds(layout.cuts, layout.n_tokens, degree)
    # shards are cut on window boundaries, so window blocks stay local
    assert all(b in layout.cuts for b in bounds)
    assert 0 < bounds[1] < layout.n_tokens

    results = run_ulysses(degree, 1, family, inputs, upstream_grads(family, inputs))
    full_layers = len(cfg.fullatt_block_indexes)
    assert 0 < full_layers < cfg.depth
    for r, res in enumerate(results):
        n_local = bounds[r + 1] - bounds[r]
        kw = dict(
            n_total=layout.n_tokens,
            degree=degree,
            heads=cfg.num_heads,
            head_dim=cfg.hidden_size // cfg.num_heads,
        )
        expected = analytic_all_to_all_bytes(n_local, full_layers=full_layers, **kw)
        if_every_block = analytic_all_to_all_bytes(n_local, full_layers=cfg.depth, **kw)
        measured = res["all_to_all_bytes"]
        # byte for byte: the window blocks send nothing at all
        assert measured == expected, (r, n_local, measured, expected, if_every_block)
        assert measured < if_every_block
