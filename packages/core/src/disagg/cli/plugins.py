"""``disagg plugins``: what is installed, what each plugin registered, what failed."""

from __future__ import annotations

import argparse
import json
from typing import Any

HELP = "list the loaded plugins, their hooks and what they registered"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def report() -> dict[str, Any]:
    """The data ``disagg plugins --json`` prints."""
    from disagg.plugins import get_registry

    reg = get_registry()
    return {
        "plugins": [
            {
                "name": p.name,
                "version": p.version,
                "distribution": p.distribution,
                "hooks": p.hooks,
                "registered": p.registered,
            }
            for p in reg.plugins.values()
        ],
        "failed": [{"name": name, "error": error} for name, error in sorted(reg.failures.items())],
    }


def run(args: argparse.Namespace) -> int:
    data = report()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    for p in data["plugins"]:
        dist = f"({p['distribution']})" if p["distribution"] else ""
        print(" ".join(x for x in (p["name"], p["version"], dist) if x))
        print(f"  hooks: {', '.join(p['hooks']) or '-'}")
        for kind, names in p["registered"].items():
            print(f"  {kind}: {', '.join(names)}")
    for f in data["failed"]:
        print(f"{f['name']} FAILED")
        print(f"  error: {f['error']}")
    return 0
