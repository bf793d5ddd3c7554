"""``disagg`` entry point: argparse subcommands and the error policy.

Each subcommand is a module with ``HELP: str``, ``add_arguments(parser)`` and
``run(args) -> int``; add one by adding a line to :data:`COMMANDS`. Modules
must import heavy things (torch, ray) inside ``run`` so that ``disagg --help``
and config errors stay fast.

Errors: a :class:`~disagg.config.ConfigError` exits with 2, any other error
with 1; the message goes to stderr without a traceback unless ``--traceback``
or ``DISAGG_TRACEBACK=1``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence

#: subcommand -> module implementing it
COMMANDS: dict[str, str] = {
    "train": "disagg.cli.train",
    "plugins": "disagg.cli.plugins",
    "make-tiny": "disagg.cli.make_tiny",
    "export": "disagg.cli.export",
    "bench": "disagg.cli.bench",
    "plan": "disagg.cli.plan",
    "data": "disagg.cli.data",
    "plot": "disagg.cli.plot",
}

#: commands that load the plugins before their first output, and what they are doing
SLOW_START: dict[str, str] = {
    "train": "checking the config (loading plugins)...",
    "data": "checking the config (loading plugins)...",
    "plan": "reading the model configs (loading plugins)...",
    "bench": "checking the config (loading plugins)...",
    "export": "loading plugins...",
    "plugins": "loading plugins...",
}

EXIT_RUNTIME_ERROR = 1
EXIT_CONFIG_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    from disagg import __version__

    parser = argparse.ArgumentParser(
        prog="disagg", description="Disaggregated hybrid parallelism for multimodal training on Ray."
    )
    parser.add_argument("--version", action="version", version=f"disagg {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--traceback", action="store_true", help="show the full traceback on errors (or DISAGG_TRACEBACK=1)"
    )
    common.add_argument(
        "--verbose",
        action="store_true",
        help="show the third-party warnings and log lines disagg filters as noise (or DISAGG_VERBOSE=1)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP, parents=[common])
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    show_tb = args.traceback or os.environ.get("DISAGG_TRACEBACK", "") not in ("", "0")
    if args.verbose:
        from disagg import noise

        noise.set_verbose()
    if args.command in SLOW_START:
        # loading the plugins (torch, megatron-core, deepspeed) takes seconds: say so at once
        print(f"disagg {args.command}: {SLOW_START[args.command]}", file=sys.stderr, flush=True)
    from disagg.config.errors import ConfigError

    try:
        return int(args._run(args) or 0)
    except ConfigError as exc:
        return _fail(exc, EXIT_CONFIG_ERROR, show_tb)
    except KeyboardInterrupt:
        print("disagg: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        return _fail(exc, EXIT_RUNTIME_ERROR, show_tb, prefix=f"error: {type(exc).__name__}: ")


def _fail(exc: BaseException, code: int, show_tb: bool, prefix: str = "") -> int:
    if show_tb:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"disagg: {prefix}{exc}", file=sys.stderr)
    if not show_tb:
        print("(run with --traceback or DISAGG_TRACEBACK=1 for details)", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
