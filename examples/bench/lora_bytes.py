"""State bytes per rank and gradient bytes communicated per step, LoRA / full, on the tiny
Qwen2.5-VL, measured beside the analytic figures (``disagg.kit.cost.rules``).

    python examples/bench/lora_bytes.py [--out DIR]

Two gloo ranks on the CPU run one step of each module under ``ddp`` (2 replicas),
first training every weight, then LoRA (the tower: ``attn.qkv`` and ``attn.proj``
at r 8 with the merger in full; the LLM: its seven linears per layer at r 16), and
report what ``Strategy.state_bytes`` holds (parameters + gradients + AdamW state)
and what the step's collectives sent (``CommCounter``: the gradient all-reduce
and its presence agreement), against what the cost model predicts for the same
layout from the model's ``config.json`` alone (``ddp``'s ``Strategy.estimate`` with
``CostQuery.lora``: the family's planning shape, its targeted linears frozen with
a ``lora_A``/``lora_B`` pair each, :mod:`disagg.kit.cost.training`): state
bytes and gradient bytes sent per step.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from disagg.interfaces import OptimSpec
from disagg.interfaces.lora import LoraSpec

VISION = LoraSpec(
    r=8,
    alpha=16,
    dropout=0.0,
    targets=("attn.qkv", "attn.proj"),
    modules_to_save=("merger",),
    save_patterns=("merger.*",),
)
LLM = LoraSpec(
    r=16,
    alpha=32,
    dropout=0.0,
    targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
)


def _rank(rank: int, path: str) -> bytes:
    from disagg.builtin.ddp import DDPStrategy
    from disagg.kit.lora import apply_lora
    from disagg.plugins import get_registry
    from disagg.testing import ranks
    from disagg.testing.encoder import upstream_grads
    from disagg.testing.ranks import dumps
    from disagg_vision_sp.testing import random_images

    reg = get_registry()
    out = {}
    for m, spec in (("vision", VISION), ("llm", LLM)):
        family = reg.family("encoder" if m == "vision" else "llm", "qwen2_5_vl")(path)
        for mode in ("full", "lora"):
            lora = spec if mode == "lora" else None
            module = family.build(torch.float32)
            if lora is not None:
                module = apply_lora(module, lora, m, f"train.modules.{m}.lora")
            ctx = ranks.rank_context(m, rank, 1, 2)
            strat = ranks.strategy_rank(
                DDPStrategy, family, ctx, optim=OptimSpec(lr=1e-3, lora=lora), module=module
            )
            if m == "vision":
                x = family.preprocess(random_images([(56, 56)], seed=rank))
                ranks.encode_and_backward(strat, 0, [x], upstream_grads(family, [x], seed=rank))
            else:
                ids = torch.randint(
                    20, family.text_config.vocab_size, (12,), generator=torch.Generator().manual_seed(rank)
                )
                sample = {"input_ids": ids, "labels": ids.clone()}
                ranks.loss_and_backward(strat, 0, [sample], [{}], 1.0 / 22)
            ctx.comm.reset()
            norm_sq = ranks.reduce(strat)
            ranks.step(strat, norm_sq, 1.0, zero_grad=False)
            sent = ctx.comm.total()
            held = ranks.state_bytes(strat)
            named = list(strat.module.named_parameters())
            out[f"{m}/{mode}"] = {
                "state_bytes": held,
                "grad_bytes_sent": sent,
                "trainable": sum(p.numel() for _, p in named if p.requires_grad),
                "frozen": sum(p.numel() for _, p in named if not p.requires_grad),
            }
    return dumps(out)


def analytic(path: str) -> dict:
    """The cost model's figures for the same two ranks (``ddp``, 2 replicas), from ``config.json``."""
    from disagg.cost import predict
    from disagg.cost.shapes import shapes_for

    config = json.loads((Path(path) / "config.json").read_text())
    shapes = shapes_for({"vision": config, "llm": config}, {"vision": "qwen2_5_vl", "llm": "qwen2_5_vl"})
    out = {}
    for m, spec in (("vision", VISION), ("llm", LLM)):
        for mode in ("full", "lora"):
            cost = predict(shapes[m], "ddp", 1, 2, 64, "fp32", lora=spec if mode == "lora" else None)
            out[f"{m}/{mode}"] = {
                "state_bytes_analytic": cost.state_bytes,
                # the group's own collectives: ddp's gradient reduction
                "grad_bytes_analytic": sum(cost.comm_bytes_by_kind.values()),
            }
    return out


def measure(path: str) -> dict:
    from disagg.testing.dist import run_ranks
    from disagg.testing.ranks import loads

    rows = loads(run_ranks(_rank, 2, path)[0])
    for key, figures in analytic(path).items():
        rows[key].update(figures)
    return rows


def table(rows: dict) -> str:
    lines = [
        "| module | mode | trainable | state B/rank (measured / analytic) "
        "| grad B sent/step (measured / analytic) |",
        "|---|---|---|---|---|",
    ]
    for key, r in rows.items():
        m, mode = key.split("/")
        lines.append(
            f"| {m} | {mode} | {r['trainable']:,} | {r['state_bytes']:,} / {r['state_bytes_analytic']:,} "
            f"| {r['grad_bytes_sent']:,} / {r['grad_bytes_analytic']:,} |"
        )
    for m in ("vision", "llm"):
        f, lo = rows[f"{m}/full"], rows[f"{m}/lora"]
        lines.append(
            f"| {m} | LoRA / full | | {lo['state_bytes'] / f['state_bytes']:.3f} / "
            f"{lo['state_bytes_analytic'] / f['state_bytes_analytic']:.3f} "
            f"| {lo['grad_bytes_sent'] / f['grad_bytes_sent']:.3f} / "
            f"{lo['grad_bytes_analytic'] / f['grad_bytes_analytic']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from disagg.cli.make_tiny import make_tiny

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="where the tiny model goes (default a temp dir)")
    args = p.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="lora_bytes_"))
    manifest = make_tiny(root, ["qwen2_5_vl"], data=False)
    rows = measure(manifest["models"]["qwen2_5_vl"])
    print(table(rows))
    (root / "lora_bytes.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
