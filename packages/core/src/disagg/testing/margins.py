"""Summarise a ``DISAGG_MARGIN_LOG`` file: the checks closest to their bound, per test.

``python -m disagg.testing.margins LOG [LOG ...] [--top 10] [--max 0.5]`` prints, for every
(test, check) pair, its largest margin (largest error / bound) over all the logs, the ``--top``
largest first, and exits 1 if any margin exceeds ``--max``. Checks of kind ``... adam-limit`` (a
hard limit that rounding can reach, not an estimate: ``disagg.testing.tolerance``) and ``exact``
are listed apart and not held to ``--max`` (an exact check fails at any difference anyway).
A check above 1 raised its ``AssertionError``: either its test failed (pytest says so) or the test
expected it to (the policy's own tests inject an lr, a doubled update: ``pytest.raises``); such a
test is set apart with all its checks (the ones that passed compared a corrupted input too), so
the ranking is of the checks of tests that injected nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load(paths: list[Path]) -> dict[tuple[str, str, str], float]:
    """(test, what, kind) -> largest margin over every line of every log."""
    out: dict[tuple[str, str, str], float] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            key = (rec["test"], rec["what"], rec["kind"])
            out[key] = max(out.get(key, 0.0), float(rec["margin"]))
    return out


def _held(kind: str) -> bool:
    return not (kind.endswith("adam-limit") or kind == "exact")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg.testing.margins", description=__doc__)
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--max", type=float, default=None, help="fail if a held margin exceeds this")
    args = parser.parse_args(argv)
    margins = load(args.logs)
    raised = sorted(k for k, m in margins.items() if m > 1.0)
    # a test with a raised check injected an error (or failed): its other checks compare against
    # that corrupted input too, so their margins say nothing about rounding; set the test apart
    injected = {k[0] for k in raised}
    margins = {k: m for k, m in margins.items() if k[0] not in injected}
    held = sorted(((m, k) for k, m in margins.items() if _held(k[2])), reverse=True)
    limit = sorted(((m, k) for k, m in margins.items() if not _held(k[2])), reverse=True)
    tests = {k[0] for k in margins}
    if raised:
        where = sorted({k[0] for k in raised})
        print(
            f"{len(raised)} checks raised (margin > 1: an expected failure, or a failed test); "
            f"every check of these tests is set apart: {where}"
        )
    print(f"{len(margins)} checks in {len(tests)} tests; the {args.top} closest to their bound:")
    for m, (test, what, kind) in held[: args.top]:
        print(f"  {m:8.4f}  {test}  {what}  [{kind}]")
    if limit:
        print(f"hard-limit / exact checks (not held to --max), the {min(args.top, len(limit))} largest:")
        for m, (test, what, kind) in limit[: args.top]:
            print(f"  {m:8.4f}  {test}  {what}  [{kind}]")
    over = [(m, k) for m, k in held if args.max is not None and m > args.max]
    if over:
        print(f"{len(over)} checks above --max {args.max}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
