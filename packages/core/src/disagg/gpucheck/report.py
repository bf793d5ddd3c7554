"""The one JSON report, and the verdict: every part ran and passed, or the exit status says not."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PARTS = ("correctness", "calibration", "memory", "mechanism")


def _plain(x: Any) -> Any:
    """JSON without NaN/Infinity (strict parsers refuse them): a non-finite number as a string."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def verdict(report: dict[str, Any]) -> list[str]:
    """Why the check fails (empty: it passed). Nothing ran, a part missing or errored, a part
    not ok, a layout that failed, a fault not caught: each is a reason."""
    why = []
    parts = report.get("parts", {})
    if not parts:
        why.append("nothing ran")
    for p in PARTS:
        rec = parts.get(p)
        if rec is None:
            why.append(f"part {p!r} did not run")
        elif rec.get("error"):
            why.append(f"part {p!r} raised: {rec['error']}")
        elif not rec.get("ok"):
            why.append(f"part {p!r} failed")
    corr = parts.get("correctness") or {}
    for name, rec in (corr.get("layouts") or {}).items():
        if not rec.get("ok"):
            why.append(f"layout {name}: {(rec.get('failures') or ['?'])[0]}")
    for fault, rec in (corr.get("faults") or {}).items():
        if not rec.get("caught"):
            why.append(f"injected fault {fault!r} was not caught")
    if corr and not corr.get("layouts"):
        why.append("no strategy layout ran")
    return why


def write(report: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_plain(report), indent=1))
    return path


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The figures worth reading at a glance."""
    parts = report.get("parts", {})
    lines = []
    corr = parts.get("correctness") or {}
    for name, rec in (corr.get("layouts") or {}).items():
        m = rec.get("margins") or {}
        status = "ok" if rec.get("ok") else "FAIL"
        lines.append(
            f"correctness {name:18s} {status:4s} margins loss {m.get('loss', float('nan')):.3g} "
            f"grads {m.get('grads', float('nan')):.3g} params {m.get('params', float('nan')):.3g} "
            f"mfu {rec.get('mfu') or 0:.3g}"
        )
    for name, rec in (corr.get("layouts") or {}).items():
        mem = rec.get("memory") or {}
        if mem:
            pred = (mem.get("predicted_bytes") or {}).get("total")
            lines.append(
                f"memory {name:18s} max_memory_allocated {mem.get('measured_bytes')} predicted {pred} "
                f"ratio {mem.get('measured_over_predicted')}"
            )
    for fault, rec in (corr.get("faults") or {}).items():
        lines.append(
            f"fault {fault:14s} {'caught' if rec.get('caught') else 'NOT CAUGHT'}: {rec.get('first_failure')}"
        )
    cal = parts.get("calibration") or {}
    for term, rec in (cal.get("predicted_over_measured") or {}).items():
        lines.append(f"calibration {term}: predicted/measured {rec}")
    mem = parts.get("memory") or {}
    for p in ("vision_block", "llm_layer"):
        if p in mem:
            r = mem[p]
            lines.append(
                f"memory {p}: measured {r.get('measured_bytes')} predicted {r['predicted_bytes']} "
                f"ratio {r.get('measured_over_predicted')}"
            )
    mech = parts.get("mechanism") or {}
    if "ulysses_over_tp_throughput" in mech:
        lines.append(
            f"mechanism: vision tower throughput ulysses/tp{mech['degree']} shapes "
            f"{mech['ulysses_over_tp_throughput']:.3g} (ulysses mfu {mech['ulysses']['mfu']:.3g}, "
            f"tp mfu {mech['tp']['mfu']:.3g})"
        )
    return lines
