"""One ``disagg bench`` record from runs of the same config over different layouts.

    python examples/bench/merge_runs.py OUT_DIR RUN_DIR [RUN_DIR ...]

Each ``RUN_DIR`` holds a ``bench.json`` that ``disagg bench`` wrote; their points, budget
searches and probes are joined and ``bench.json``, ``bench.md`` and the plots written again
into ``OUT_DIR``, targets included, by the bench's own writer, as if one run had measured
every layout. Memory and bytes do not depend on the machine's load, so a layout measured in
another run compares with the rest; tokens/s do, so throughput ratios across runs are not
figures. The runs must share precision, samples, steps, seed, placement, lengths and budget
(it refuses them otherwise) and name different layouts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

#: what every run must agree on to be one record
SHARED = ("precision", "samples_per_step", "steps", "seed", "placement", "vision_tokens", "mem_budget_bytes")


def merge(runs: list[dict[str, Any]]) -> tuple[SimpleNamespace, dict[str, Any] | None]:
    """A bench-like object for :func:`disagg.bench.output.write_outputs`, and the joined search."""
    first = runs[0]["config"]
    for r in runs[1:]:
        differ = [k for k in SHARED if r["config"].get(k) != first.get(k)]
        if differ:
            raise SystemExit(f"runs differ in {', '.join(differ)}: not one bench")
    layouts: dict[str, Any] = {}
    points: list[dict[str, Any]] = []
    search: dict[str, Any] = {}
    for r in runs:
        clash = set(layouts) & set(r["layouts"])
        if clash:
            raise SystemExit(f"layouts {sorted(clash)} are in more than one run")
        layouts.update(r["layouts"])
        points += r["points"]
        for name, s in (r.get("budget_search") or {}).items():
            probes = [p for p in r.get("budget_probes", []) if p["layout"] == name]
            search[name] = {**s, "probes": probes}
    bench = SimpleNamespace(
        precision=first["precision"],
        samples=first["samples_per_step"],
        steps=first["steps"],
        base=SimpleNamespace(train=SimpleNamespace(seed=first["seed"])),
        placement=first["placement"],
        vision_tokens=first["vision_tokens"],
        budget=first["mem_budget_bytes"],
        layouts=layouts,
        points=points,
        registry=None,
    )
    return bench, search or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--degree", type=int, default=2, help="the d of the targets")
    args = ap.parse_args()
    from disagg.bench.output import write_outputs

    runs = [json.loads((d / "bench.json").read_text()) for d in args.runs]
    bench, search = merge(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    bench.out_dir = args.out
    files = write_outputs(bench, search, args.degree, [])
    print(files["table_text"])


if __name__ == "__main__":
    main()
