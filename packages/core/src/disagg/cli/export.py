"""``disagg export CHECKPOINT OUT_DIR``: Hugging Face dirs from a checkpoint."""

from __future__ import annotations

import argparse

HELP = "write Hugging Face dirs (loadable by from_pretrained) from a checkpoints/step-N dir"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a run's checkpoints/step-N dir")
    parser.add_argument("out_dir", help="where to write the HF dir(s)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from disagg.config.errors import ConfigError, Problem
    from disagg.plugins import get_registry
    from disagg.runtime.checkpoint import export_checkpoint

    ckpt = Path(args.checkpoint)
    if not (ckpt / "meta.json").is_file():
        raise ConfigError(
            [
                Problem(
                    key="CHECKPOINT",
                    message=f"{ckpt} is not a checkpoint dir (no meta.json); pass a run's checkpoints/step-N",
                )
            ]
        )
    for path in export_checkpoint(ckpt, args.out_dir, get_registry()):
        print(path)
    return 0
