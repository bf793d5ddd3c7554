"""Shared by the end-to-end tests: a validated config for a tiny VLM dir and a
`run_training` call that returns the logged losses and the final full weights."""

from __future__ import annotations

import json
from pathlib import Path

from disagg.config.schema import Config
from disagg.config.validate import validate
from disagg.plugins import get_registry
from disagg.runtime.actor.state import read_module_state

DDP = {"strategy": "ddp", "degree": 1, "replicas": 1}


def e2e_config(
    tiny: dict, out: Path, families: dict[str, str], parallel: dict, steps: int, checkpoint_every: int = 0
) -> Config:
    """``families``: module -> (family, name of the tiny dir in ``tiny["models"]``);
    ``checkpoint_every``: 1 keeps every step's weights (compared step by step)."""
    cfg = Config.model_validate(
        {
            "model": {m: {"family": fam, "path": tiny["models"][d]} for m, (fam, d) in families.items()},
            "parallel": parallel,
            "data": {
                "train": tiny["data"]["train"],
                "media_root": tiny["media_root"],
                "batch_size": 4,
                "num_workers": 1,
            },
            # eps=1e-3: Adam's update is then Lipschitz in the gradient, so fp32
            # summation-order noise in near-zero gradients cannot flip parameters.
            "train": {"steps": steps, "lr": 1e-3, "eps": 1e-3, "seed": 0, "clip_grad_norm": 1.0},
            "checkpoint": {"every": checkpoint_every},
            "output_dir": str(out),
        }
    )
    validate(cfg, get_registry())
    return cfg


def train(cfg: Config) -> tuple[list[float], dict[str, dict]]:
    from disagg.runtime.run import run_training

    run_training(validate(cfg, get_registry()), progress=False)
    out = Path(cfg.output_dir)
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    ckpt = out / "checkpoints" / f"step-{cfg.train.steps}"
    return losses, {m: read_module_state(ckpt, m)[0] for m in cfg.modules()}
