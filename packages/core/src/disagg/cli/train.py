"""``disagg train``: load and validate the config, then hand it to the runtime."""

from __future__ import annotations

import argparse

HELP = "train from a YAML config (validated before any actor starts)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the run's YAML config")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.lr=1e-4 (repeatable; values are YAML)",
    )
    parser.add_argument(
        "--address", default=None, help="Ray address to join (e.g. 'auto'); default: ray.address or local Ray"
    )


def run(args: argparse.Namespace) -> int:
    from disagg.config.load import load_config_and_source
    from disagg.config.validate import validate
    from disagg.plugins import get_registry

    cfg, source = load_config_and_source(args.config, args.overrides)
    validate(cfg, get_registry(), source=source)
    # Only now, with a config known to be sound, do we touch Ray.
    from disagg.runtime.run import run_training

    address = args.address if args.address is not None else cfg.ray.address
    run_training(cfg, address=address)
    return 0
