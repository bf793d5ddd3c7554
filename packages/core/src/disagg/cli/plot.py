"""``disagg plot RUN_DIR``: loss, eval loss, throughput and memory PNGs from ``metrics.jsonl``."""

from __future__ import annotations

import argparse

HELP = (
    "draw loss / eval loss, throughput, memory and per-module FLOPs / MFU / tokens / idle PNGs "
    "from a run dir's metrics.jsonl"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run's output_dir (holding metrics.jsonl)")
    parser.add_argument("--out", default=None, help="where to write the PNGs (default RUN_DIR/plots)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from disagg.config.errors import ConfigError, Problem
    from disagg.metrics.plot import INSTALL_HINT, plot_run

    metrics = Path(args.run_dir) / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(
            [Problem(key="RUN_DIR", message=f"{args.run_dir} has no metrics.jsonl; pass a run's output_dir")]
        )
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(INSTALL_HINT) from None
    for path in plot_run(Path(args.run_dir), Path(args.out) if args.out else None):
        print(path)
    return 0
