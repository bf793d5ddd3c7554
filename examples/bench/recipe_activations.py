"""Saved-activation bytes per rank under each ``train.precision`` recipe on the tiny Qwen2.5-VL,
measured beside the cost model's figure (``Strategy.estimate`` with ``CostQuery.precision``).

    python examples/bench/recipe_activations.py

Two gloo ranks on the CPU run one microbatch of each module per recipe (``fp32``, ``bf16``,
``bf16-pure``): the tower under ``ulysses`` 2 (one image of whole attention windows per rank),
the LLM under ``megatron_tp`` 2 with sequence parallelism (one text sample of 96 tokens, the
chunked loss), and count what autograd saves as the worker does (every forward save, plus the
largest replay of a checkpointed region on top), against what the cost model predicts for the
same step from ``config.json`` alone.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

RECIPES = ("fp32", "bf16", "bf16-pure")
IMAGE = (64, 32)  # 16 x 8 patches: 8 attention windows of 4 x 4, 4 per rank
TEXT_TOKENS = 96


def _saved(strat, run) -> int:
    from disagg.kit.recompute.activations import saved_bytes_hooks

    added, peaks = [], []
    with saved_bytes_hooks(strat.module, added.append, peaks.append):
        run()
    return sum(added) + max(peaks, default=0)


def _rank(rank: int, path: str) -> bytes:
    from disagg.interfaces import OptimSpec
    from disagg.plugins import get_registry
    from disagg.testing import ranks
    from disagg.testing.encoder import upstream_grads
    from disagg.testing.ranks import dumps
    from disagg_llm_tp.strategy import MegatronTPOptions, MegatronTPStrategy
    from disagg_vision_sp.testing import random_images
    from disagg_vision_sp.ulysses.strategy import UlyssesStrategy

    reg = get_registry()
    vision = reg.family("encoder", "qwen2_5_vl")(path)
    llm = reg.family("llm", "qwen2_5_vl")(path)
    x = vision.preprocess(random_images([IMAGE], seed=0))
    ids = torch.randint(
        20, llm.text_config.vocab_size, (TEXT_TOKENS,), generator=torch.Generator().manual_seed(0)
    )
    sample = {"input_ids": ids, "labels": ids.clone()}
    out = {"vision_tokens": int(torch.prod(x["image_grid_thw"][0]))}
    for precision in RECIPES:
        ctx = ranks.rank_context("vision", rank, 2, 1, precision=precision)
        strat = ranks.strategy_rank(UlyssesStrategy, vision, ctx, optim=OptimSpec(lr=1e-3))
        grads = [g.to(ctx.dtype) for g in upstream_grads(vision, [x])]
        out[f"vision/{precision}"] = _saved(
            strat, lambda s=strat, g=grads: ranks.encode_and_backward(s, 0, [x], g)
        )
        ctx = ranks.rank_context("llm", rank, 2, 1, precision=precision)
        opts = MegatronTPOptions(sequence_parallel=True)
        strat = ranks.strategy_rank(MegatronTPStrategy, llm, ctx, options=opts, optim=OptimSpec(lr=1e-3))
        out[f"llm/{precision}"] = _saved(
            strat, lambda s=strat: ranks.loss_and_backward(s, 0, [sample], [{}], 1.0 / TEXT_TOKENS)
        )
    return dumps(out)


def analytic(path: str, vision_tokens: int) -> dict[str, int]:
    """The cost model's saved-activation bytes for the same steps, from ``config.json``."""
    from disagg.cost import predict
    from disagg.cost.shapes import shapes_for

    config = json.loads((Path(path) / "config.json").read_text())
    shapes = shapes_for({"vision": config, "llm": config}, {"vision": "qwen2_5_vl", "llm": "qwen2_5_vl"})
    out = {}
    for precision in RECIPES:
        v = predict(shapes["vision"], "ulysses", 2, 1, vision_tokens, precision, samples=1)
        t = predict(
            shapes["llm"],
            "megatron_tp",
            2,
            1,
            TEXT_TOKENS,
            precision,
            samples=1,
            exchanged_rows=0,
            exchanged_width=shapes["llm"].hidden,
            options={"sequence_parallel": True},
        )
        out[f"vision/{precision}"], out[f"llm/{precision}"] = v.activation_bytes, t.activation_bytes
    return out


def rows(path: str, per_rank: list[dict]) -> dict[str, dict[str, int]]:
    """Per module and recipe: the busiest rank's measured bytes (``per_rank``: what each
    rank's :func:`_rank` returned) and the analytic ones."""
    want = analytic(path, per_rank[0]["vision_tokens"])
    return {k: {"measured": max(r[k] for r in per_rank), "analytic": v} for k, v in want.items()}


def measure(path: str) -> dict[str, dict[str, int]]:
    from disagg.testing.dist import run_ranks
    from disagg.testing.ranks import loads

    return rows(path, [loads(r) for r in run_ranks(_rank, 2, path)])


def with_lora_bytes(rank: int, path: str) -> bytes:
    """This and ``lora_bytes.py``'s measurement in one spawn of two ranks (the tests share it)."""
    from lora_bytes import _rank as lora_rank

    from disagg.testing.ranks import dumps, loads

    return dumps({"lora": loads(lora_rank(rank, path)), "recipes": loads(_rank(rank, path))})


def main() -> int:
    from disagg.cli.make_tiny import make_tiny

    root = Path(tempfile.mkdtemp(prefix="recipe_activations_"))
    rows = measure(make_tiny(root, ["qwen2_5_vl"], data=False)["models"]["qwen2_5_vl"])
    print("| module / recipe | saved bytes per rank, measured | analytic | analytic / measured |")
    print("|---|---|---|---|")
    for k, r in rows.items():
        print(f"| {k} | {r['measured']:,} | {r['analytic']:,} | {r['analytic'] / r['measured']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
