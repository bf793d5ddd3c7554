"""``disagg export CHECKPOINT OUT_DIR``: Hugging Face dirs from a checkpoint, and
``OUT_DIR/disagg_model.json``, the manifest that reassembles a model composed of several dirs."""

from __future__ import annotations

import argparse

HELP = (
    "write Hugging Face dirs (loadable by from_pretrained) from a checkpoints/step-N dir, "
    "plus disagg_model.json naming each dir's module, family and options"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a run's checkpoints/step-N dir")
    parser.add_argument("out_dir", help="where to write the HF dir(s)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from disagg.config.errors import ConfigError, Problem
    from disagg.plugins import get_registry
    from disagg.runtime.export import MANIFEST, export_checkpoint

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
    print(Path(args.out_dir) / MANIFEST)
    return 0
