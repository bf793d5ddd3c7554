"""Say what the planner found: the top layouts, why the best wins, the YAML to train it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from disagg.interfaces import EncoderShape
from disagg.plan.model import Layout
from disagg.plan.own import OwnLayout
from disagg.plan.search import PlanResult

GiB = 2**30


def table(result: PlanResult, top: int) -> str:
    """The ``top`` fitting layouts (and the measured figures when profiled)."""
    modules = list(result.workload.shapes)
    lines = [result.cluster.describe(), _workload(result)]
    head = f"{'#':>2}  {'step s':>8}  {'mem GiB':>7}  " + "  ".join(
        f"{m + ': strategy':<38} {'s':>7} {'GB sent':>8} {'GiB':>6}" for m in modules
    )
    profiled = any(x.measured for x in result.ranked[:top])
    lines.append(head + ("  measured tok/s" if profiled else ""))
    for k, x in enumerate(result.ranked[:top], 1):
        cells = []
        for m in modules:
            c, t = x.costs[m], sum(x.times[m].values())
            cells.append(
                f"{x.groups[m].label():<38} {t:>7.3f} {c.comm_bytes / 1e9:>8.3f} {c.memory_bytes / GiB:>6.2f}"
            )
        row = f"{k:>2}  {x.step_time_s:>8.4f}  {x.memory_bytes / GiB:>7.2f}  " + "  ".join(cells)
        if profiled:
            row += f"  {x.measured['tokens_per_s']:.1f}" if x.measured else "  -"
        lines.append(row + f"  [{x.placement}, {x.microbatches} mb, {x.schedule}]")
    if not result.ranked:
        lines.append("(no layout fits" + (", also with mlp_tiles: auto)" if result.tiled else ")"))
    elif result.tiled:
        lines.append("nothing fits without tiles: mlp_tiles: auto offered (the fallback pass)")
    for name, why in result.skipped.items():
        lines.append(f"skipped: {name}: {why}")
    for m, names in result.not_for.items():
        lines.append(f"not for {m}: {', '.join(names)} (report no cost for this module)")
    return "\n".join(lines)


def _workload(result: PlanResult) -> str:
    w = result.workload
    vision = w.shapes.get("vision")
    size = ""
    if isinstance(vision, EncoderShape):
        # tokens as `disagg data check` counts them (the LLM's rows); patches: the encoder's positions
        size = f"{w.vision_tokens // vision.unit} vision tokens ({w.vision_tokens} patches) + "
    return (
        f"workload: {w.samples} samples/step, {size}{w.text_tokens} text tokens "
        f"per sample, recompute {'required where a strategy can' if w.recompute else 'searched per module'}; "
        f"{len(result.ranked)} layouts fit, {len(result.oom)} out of memory"
    )


def why(result: PlanResult, rivals: int = 3) -> list[str]:
    """Sentences: the best against the best of other strategy mixes, and the
    faster layouts that do not fit."""
    best = result.best
    lines = [
        f"best: {best.name()}: {best.step_time_s:.4g} s/step predicted, "
        f"{best.memory_bytes / GiB:.2f} of {result.cluster.memory_budget / GiB:.2f} GiB per device"
    ]
    lines += keys_lines(result)
    seen = {_mix(best)}
    for x in result.ranked[1:]:
        if _mix(x) in seen:
            continue
        seen.add(_mix(x))
        lines.append(f"  vs {x.name()}: {x.step_time_s / best.step_time_s:.3f}x the time; {_diff(best, x)}")
        if len(seen) > rivals:
            break
    shown: set[tuple[str, ...]] = set()
    for x in result.oom:
        if x.step_time_s >= best.step_time_s or _mix(x) in shown:
            continue
        shown.add(_mix(x))
        lines.append(
            f"  faster but out of memory: {x.name()}: {best.step_time_s / x.step_time_s:.3f}x the speed, "
            f"needs {x.memory_bytes / GiB:.2f} GiB per device"
        )
        if len(shown) >= rivals:
            break
    return lines


def _keys(x: Layout) -> list[str]:
    """``module: key=value`` of the layout keys beyond strategy and mesh that the plan chose:
    context parallelism, optimizer offload and the MLPs over sequence tiles."""
    out = []
    for m, g in x.groups.items():
        o = dict(g.options)
        if g.context_parallel > 1:
            out.append(f"{m}: context_parallel={g.context_parallel} ({g.ranks} ranks)")
        if o.get("offload", "none") != "none" or o.get("offload_optimizer"):
            out.append(f"{m}: offload=optimizer")
        if o.get("mlp_tiles", 1) != 1:
            out.append(f"{m}: mlp_tiles={o['mlp_tiles']}")
    return out


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / 2**20:.2f} MiB"


def _kinds(x: Layout) -> set[str]:
    return {k.split(": ")[1].split("=")[0] for k in _keys(x)}


def keys_lines(result: PlanResult) -> list[str]:
    """Why the best layout uses context parallelism or optimizer offload, where it does, one line per
    key: the fastest fitting layout without it and the time term it loses by, or, when none without it
    fits, the smallest such layout and the memory terms the key saves on the worst device."""
    best = result.best
    keys = _keys(best)
    if not keys:
        return []
    lines = [f"  uses {'; '.join(keys)}"]
    for kind in sorted(_kinds(best)):
        plain = [x for x in result.ranked if kind not in _kinds(x)]
        if plain:
            x = plain[0]
            lines.append(
                f"  {kind} wins on time: the fastest without it, {x.name()}, takes "
                f"{x.step_time_s / best.step_time_s:.3f}x the time; {_diff(best, x)}"
            )
            continue
        oom = [x for x in result.oom if kind not in _kinds(x)]
        if not oom:
            lines.append(f"  {kind}: every layout searched uses it")
            continue
        x = min(oom, key=lambda y: y.memory_bytes)
        saved = sorted(
            ((x.memory_terms.get(k, 0) - v, k) for k, v in best.memory_terms.items()), reverse=True
        ) or [(x.memory_bytes - best.memory_bytes, "memory")]
        terms = ", ".join(f"{k} -{_size(d)}" for d, k in saved[:2] if d > 0) or "none"
        lines.append(
            f"  {kind} wins on memory: nothing without it fits (the smallest, {x.name()}, needs "
            f"{x.memory_bytes / GiB:.2f} of {result.cluster.memory_budget / GiB:.2f} GiB per device); "
            f"it saves on the worst device: {terms}"
        )
    return lines


def own_line(own: OwnLayout, result: PlanResult) -> str:
    """The config's own layout beside the best: its predicted time, memory and place."""
    if own.layout is None:
        return f"yours: not scored: {own.why}"
    x = own.layout
    text = (
        f"yours: {x.name()}, {x.microbatches} mb, {x.schedule}: {x.step_time_s:.4g} s/step predicted, "
        f"{x.memory_bytes / GiB:.2f} of {result.cluster.memory_budget / GiB:.2f} GiB per device"
    )
    rank = own.rank(result)
    if rank is None:
        return text + " (out of memory)"
    text += f"; #{rank} of {len(result.ranked)} fitting layouts"
    if result.ranked and result.best.step_time_s < x.step_time_s:
        text += f", {x.step_time_s / result.best.step_time_s:.3f}x the best's time"
    return text


def _mix(x: Layout) -> tuple[str, ...]:
    return tuple(g.strategy for g in x.groups.values()) + (x.placement,)


def _diff(best: Layout, other: Layout) -> str:
    """The two components where ``other`` loses the most time against ``best``."""
    deltas = []
    for m in best.groups:
        for k in ("compute_s", "collective_s", "overhead_s", "transfer_s", "offload_s"):
            deltas.append((other.times[m].get(k, 0.0) - best.times[m].get(k, 0.0), m, k))
    deltas.sort(reverse=True)
    parts = []
    for d, m, k in deltas[:2]:
        if d <= 0:
            break
        what = k.removesuffix("_s")
        if what == "collective":
            extra = (
                f" ({sum(other.costs[m].comm_bytes_by_kind.values()) / 1e9:.3g} vs "
                f"{sum(best.costs[m].comm_bytes_by_kind.values()) / 1e9:.3g} GB per rank, "
                f"{sum(other.costs[m].comm_calls_by_kind.values())} vs "
                f"{sum(best.costs[m].comm_calls_by_kind.values())} calls)"
            )
        elif what == "overhead":
            extra = f" ({other.microbatches} vs {best.microbatches} microbatches)"
        else:
            extra = ""
        parts.append(f"{m} {what} +{d:.3g} s{extra}")
    gain = other.step_time_s - best.step_time_s
    if not parts:
        parts.append(f"overlap of groups: +{gain:.3g} s")
    return ", ".join(parts)


def json_rows(doc: dict[str, Any], rows: tuple[str, ...]) -> str:
    """``doc`` as indented JSON, each element of its lists under ``rows`` on one line: a plan's
    tens of thousands of layouts go through the C encoder (``json.dumps`` with ``indent`` uses the
    pure-Python one, ten times slower) and stay one ``grep`` line each."""
    import json

    parts = []
    for k, v in doc.items():
        if k in rows and v:
            value = "[\n" + ",\n".join(f"  {json.dumps(x)}" for x in v) + "\n ]"
        else:
            value = json.dumps(v, indent=1).replace("\n", "\n ")
        parts.append(f" {json.dumps(k)}: {value}")
    return "{\n" + ",\n".join(parts) + "\n}"


def plan_yaml(layout: Layout) -> dict[str, Any]:
    """The config sections ``disagg train`` needs to run ``layout``."""
    return {
        "parallel": layout.parallel_section(),
        "train": {"microbatches": layout.microbatches, "schedule": layout.schedule},
    }


def write_plan(layout: Layout, path: str | Path, result: PlanResult) -> Path:
    """``plan.yaml``: the best layout's ``parallel`` and ``train`` keys, with the prediction as comments."""
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = [
        "# written by `disagg plan`; merge into a train config (or use `parallel: auto`)",
        f"# {result.cluster.describe()}",
        f"# predicted: {layout.step_time_s:.4g} s/step, {layout.memory_bytes / GiB:.2f} GiB per device",
    ]
    path.write_text("\n".join(header) + "\n" + yaml.safe_dump(plan_yaml(layout), sort_keys=False))
    return path
