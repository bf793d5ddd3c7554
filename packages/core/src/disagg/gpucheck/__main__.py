"""``python -m disagg.gpucheck [--device cuda|cpu] [--out report.json]`` (see the package doc)."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from disagg.gpucheck.report import PARTS


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m disagg.gpucheck", description=__doc__)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="default cuda; cpu: tiny shapes")
    p.add_argument(
        "--out", default="gpucheck-report.json", help="the JSON report (default gpucheck-report.json)"
    )
    p.add_argument(
        "--calibration-out",
        default=None,
        help="the calibration file part 2 writes (default: beside --out, <out>.calibration.json)",
    )
    p.add_argument(
        "--precision",
        default=None,
        choices=("fp32", "bf16"),
        help="part 1's recipe (default bf16 on cuda, fp32 on cpu)",
    )
    p.add_argument(
        "--exclude",
        default="",
        help="comma-separated strategies or layouts part 1 leaves out (reported as excluded); a strategy "
        "whose plugin is missing and not excluded is a failure",
    )
    p.add_argument(
        "--work",
        default=None,
        help="keep part 1's tiny model dir and images here (default: a temporary dir, removed)",
    )
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    return p.parse_args(argv)


def _part(report: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    t0 = time.perf_counter()
    try:
        rec = fn()
    except Exception as exc:  # one part's crash is its failure; the others still run
        rec = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    rec["seconds"] = time.perf_counter() - t0
    report["parts"][name] = rec
    print(f"[gpucheck] {name}: {'ok' if rec.get('ok') else 'FAILED'} in {rec['seconds']:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # DeepSpeed picks its accelerator at import: the CPU one unless CUDA is asked for
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if args.device == "cuda" else "cpu")
    from disagg.gpucheck import report as rep
    from disagg.gpucheck.device import NoDevice, close_world, init_world, resolve_device

    out = Path(args.out)
    wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(wanted) - set(PARTS))
    if unknown:
        print(f"--parts: unknown {unknown}; allowed: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"device": args.device, "parts": {}, "argv": sys.argv[1:]}
    try:
        device = resolve_device(args.device)
    except NoDevice as exc:
        report["error"] = str(exc)
        rep.write(report, out)
        print(f"[gpucheck] FAILED: {exc}", file=sys.stderr)
        return 1
    import torch

    report["torch"] = torch.__version__
    report["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    exclude = {x.strip() for x in args.exclude.split(",") if x.strip()}
    work = Path(args.work) if args.work else None
    t0 = time.perf_counter()
    init_world(device)
    try:
        if "correctness" in wanted:
            from disagg.gpucheck import correctness
            from disagg.plugins import get_registry

            _part(
                report,
                "correctness",
                lambda: correctness.run(device, precision, get_registry(), exclude, work),
            )
        if "calibration" in wanted:
            from disagg.gpucheck import calibration

            cal = Path(args.calibration_out or out.with_suffix(".calibration.json"))
            _part(report, "calibration", lambda: calibration.run(device, cal))
        if "memory" in wanted:
            from disagg.gpucheck import memory

            _part(report, "memory", lambda: memory.run(device))
        if "mechanism" in wanted:
            from disagg.gpucheck import mechanism

            _part(report, "mechanism", lambda: mechanism.run(device, report["parts"].get("correctness")))
    finally:
        close_world()
    report["seconds"] = time.perf_counter() - t0
    why = rep.verdict(report)
    if wanted != list(PARTS):  # a subset of parts is a partial check: it can fail, never pass
        why = [w for w in why if "did not run" not in w]
        why.append(f"only parts {', '.join(wanted)} ran (a partial check never passes)")
    report["ok"] = not why
    report["failures"] = why
    rep.write(report, out)
    for line in rep.summary_lines(report):
        print(f"[gpucheck] {line}")
    print(f"[gpucheck] report: {out}; {'PASSED' if not why else 'FAILED: ' + '; '.join(why)}", flush=True)
    return 0 if not why else 1


if __name__ == "__main__":
    sys.exit(main())
