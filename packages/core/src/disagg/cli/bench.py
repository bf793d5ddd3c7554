"""``disagg bench CONFIG``: compare parallel layouts on one model and data."""

from __future__ import annotations

import argparse

HELP = "run the same model and data under several parallel layouts; report ratios and bytes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", help="a train config (model, data, train); its parallel section is replaced"
    )
    parser.add_argument(
        "--preset",
        default="paper",
        help="variants to compare (default: paper = uniform_tp, dhp_ulysses_tp, dhp_ulysses_tp_sp, "
        "uniform_zero3)",
    )
    parser.add_argument("--degree", type=int, default=2, help="SP/TP degree (and ZeRO ranks) of every group")
    parser.add_argument("--steps", type=int, default=6, help="steps per variant (the first is not timed)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=None, help="bench.json path (default: OUTPUT_DIR/bench.json)")


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from disagg.bench.presets import PRESETS
    from disagg.bench.runner import run_variants, table
    from disagg.config.errors import ConfigError, Problem
    from disagg.config.load import load_config
    from disagg.plugins import get_registry

    if args.preset not in PRESETS:
        raise ConfigError(
            [Problem("--preset", f"unknown preset {args.preset!r}; allowed: {', '.join(PRESETS)}")]
        )
    cfg = load_config(args.config, [*args.overrides, f"train.steps={args.steps}"])
    variants = PRESETS[args.preset](args.degree, cfg.modules())
    out_dir = Path(cfg.output_dir) / "bench"
    rows = run_variants(cfg, variants, get_registry(), out_dir)
    out = Path(args.out) if args.out else out_dir / "bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(table(rows))
    print(f"bench results: {out}")
    return 0
