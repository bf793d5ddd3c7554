"""``disagg data check CONFIG``: validate a whole dataset in parallel without training."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELP = "dataset tools: 'check' preprocesses every sample of a config's data and reports problems"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = sub.add_parser(
        "check",
        help="every sample through the run's preprocessing (structure, media, lengths), no training",
    )
    check.add_argument("config", help="the run's YAML config (its data and model sections are used)")
    check.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set data.num_workers=8 (repeatable)",
    )
    check.add_argument(
        "--split", choices=["train", "eval"], default="train", help="which dataset (default: train)"
    )
    check.add_argument("--report", type=Path, default=None, help="also write the full report as JSON here")
    check.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every sample is usable, 1 when some are not (listed with file and line)."""
    from disagg.config.validate import load_checked, validate
    from disagg.plugins import get_registry

    registry = get_registry()
    cfg, source = load_checked(args.config, args.overrides, registry)
    validate(cfg, registry, source=source)
    from disagg.data.check import check_data, format_report
    from disagg.runtime.plan import families_for

    report = check_data(cfg, families_for(cfg, registry), split=args.split, progress=not args.no_progress)
    print(format_report(report))
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=2))
    return 0 if report["bad"] == 0 else 1
