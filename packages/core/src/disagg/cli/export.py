"""``disagg export CHECKPOINT OUT_DIR [--max-shard-size 5GB] [--dtype fp32|bf16] [--merge]``: Hugging Face
(sharded safetensors) dirs from a checkpoint, and
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
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest safetensors shard, as save_pretrained takes it: 5GB (default), 500MB, 100KB or "
        "bytes; several shards get model-0000k-of-0000n.safetensors and model.safetensors.index.json",
    )
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="dtype of the written floating-point weights (default fp32, the checkpoint's master weights)",
    )

    parser.add_argument(
        "--merge",
        action="store_true",
        help="modules trained with LoRA: write merged weights (W + alpha/r * B A) into the HF dir instead "
        "of a PEFT adapter dir per module under OUT_DIR/adapters/",
    )


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from disagg.config.errors import ConfigError, Problem
    from disagg.plugins import get_registry
    from disagg.runtime.export import MANIFEST, export_checkpoint
    from disagg.runtime.hf_shards import parse_max_shard_size

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
    try:
        parse_max_shard_size(args.max_shard_size)
    except ValueError as exc:
        raise ConfigError(
            [
                Problem(
                    key="--max-shard-size",
                    message=f"{args.max_shard_size!r} is not a size ({exc}); "
                    "use a number with KB, MB, GB or TB (powers of ten, as save_pretrained), or bytes",
                )
            ]
        ) from None
    written = export_checkpoint(
        ckpt,
        args.out_dir,
        get_registry(),
        max_shard_size=args.max_shard_size,
        dtype=args.dtype,
        merge=args.merge,
    )
    for path in written:
        print(path)
    print(Path(args.out_dir) / MANIFEST)
    return 0
