"""Predicted ÷ measured, per layout and vision length a bench ran: the cost model checked
against the run, never against its own recordings.

Per point, four quantities, each a ratio of the model's figure to the run's:

- ``step_time_s``: the planner's step time for the layout (:func:`disagg.plan.own.own_layout`,
  the same model ``disagg plan`` ranks with) on the time model in use (the ``cpu`` preset,
  this machine measured by ``--calibrate``, or a calibration file), against the median of the
  timed steps on the driver;
- per group, ``comm_bytes_per_rank``: the strategy's stated bytes (collectives + rows or
  gradients sent) against the most any rank sent (the wrapped collectives);
- per group, ``collective_calls_per_rank``: the calls the strategy states against the calls
  its ranks made;
- per group, ``flops``: the strategy's ``Cost.flops`` per rank times the group's ranks (for
  the bench's nominal sample) against the run's ``metrics.jsonl`` per-group ``flops`` of the
  same step (counted over the step's real samples at their own lengths; that count is checked
  against ``torch.utils.flop_counter.FlopCounterMode`` over each rank's step in
  ``tests/test_flops_measured.py``).

Times depend on the machine, so the machine's load (``os.getloadavg``) and cores are recorded
beside them: at the bench's start and end, and after each layout's run.
"""

from __future__ import annotations

import os
import platform
from typing import Any

#: the per-group quantities, in the order the table prints them
GROUP_QUANTITIES = ("comm_bytes_per_rank", "collective_calls_per_rank", "flops")


def machine_load() -> dict[str, Any]:
    """This machine's cores and load averages now (1, 5, 15 minutes)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"cores": os.cpu_count(), "loadavg_1_5_15": [round(x, 2) for x in load]}


def machine() -> dict[str, Any]:
    """What the timed figures depend on, recorded with them."""
    import torch

    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        **machine_load(),
    }


def _ratio(predicted: float | None, measured: float | None) -> dict[str, Any]:
    ratio = None
    if predicted is not None and measured is not None and measured != 0:
        ratio = predicted / measured
    return {"predicted": predicted, "measured": measured, "ratio": ratio}


def point_versus(point: dict[str, Any]) -> dict[str, Any]:
    """The ratios of one measured point (its ``predicted`` and ``measured`` sections)."""
    m, p = point["measured"], point["predicted"]
    out: dict[str, Any] = {"step_time_s": _ratio(p.get("step_time_s"), m["step_time_s"]), "groups": {}}
    for g, got in m["groups"].items():
        want = p["groups"][g]
        calls = got.get("collective_calls_per_rank")
        flops = want.get("flops")
        out["groups"][g] = {
            "comm_bytes_per_rank": _ratio(want["comm_bytes"], got["comm_bytes_per_rank"]),
            "collective_calls_per_rank": _ratio(
                sum(want["comm_calls_by_kind"].values()), None if calls is None else sum(calls.values())
            ),
            "flops": _ratio(None if flops is None else flops * want["ranks"], got.get("flops")),
        }
    return out


def _fmt(r: dict[str, Any]) -> str:
    return "-" if r["ratio"] is None else f"{r['ratio']:.3f}"


def versus_rows(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per measured point: layout, vision tokens, the ratios, the load after its run."""
    return [
        {
            "layout": p["layout"],
            "vision_tokens": p["vision_tokens"],
            **p["predicted_vs_measured"],
            "load_after": p.get("load_after"),
        }
        for p in points
        if "predicted_vs_measured" in p
    ]


def versus_md(rows: list[dict[str, Any]], time_model: dict[str, Any], machine: dict[str, Any]) -> str:
    """The short table: a row per layout and length, predicted ÷ measured per quantity."""
    modules = sorted({g for r in rows for g in r["groups"]})
    head = ["layout", "vision tokens", "step time"]
    label = {"comm_bytes_per_rank": "bytes/rank", "collective_calls_per_rank": "calls/rank", "flops": "FLOPs"}
    head += [f"{g} {label[q]}" for g in modules for q in GROUP_QUANTITIES]
    head.append("load (1 min) after")
    lines = [
        "# Predicted ÷ measured",
        "",
        f"Time model: {time_model['name']} ({time_model['source']}). Machine: {machine['cores']} cores, "
        f"load {machine['load_start']['loadavg_1_5_15']} at the start, "
        f"{machine['load_end']['loadavg_1_5_15']} at the end (1/5/15 min).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [r["layout"], str(r["vision_tokens"]), _fmt(r["step_time_s"])]
        for g in modules:
            q = r["groups"].get(g, {})
            cells += [_fmt(q[k]) if k in q else "-" for k in GROUP_QUANTITIES]
        load = r.get("load_after")
        cells.append("-" if not load else f"{load['loadavg_1_5_15'][0]:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Step time is the planner's model of the layout; bytes and calls the strategies' stated "
        "cost per rank against the wrapped collectives; FLOPs the strategies' count for the "
        "nominal sample against the run's per-group `flops` (module doc of `disagg.bench.versus`).",
    ]
    return "\n".join(lines)
