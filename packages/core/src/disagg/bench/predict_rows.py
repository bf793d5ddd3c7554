"""``disagg bench --predict --json``: the cost model's published-setting rows (Qwen2.5-VL-32B on
8 x 80 GB) in machine-readable form, nothing run. Every row names its layout (and the
``parallel`` keys it stands for), recipe, usable fraction and offload, so that a row can be
compared like for like with another that shares them."""

from __future__ import annotations

from typing import Any

from disagg.bench import published


def _offload(layout: dict[str, Any] | None) -> dict[str, str]:
    """Per module, what the layout keeps in host memory (``parallel.<m>.offload``; ``none``)."""
    if not layout:
        return {}
    return {m: str(g.get("offload") or "none") for m, g in layout.items() if isinstance(g, dict)}


def _spec(group: Any) -> dict[str, Any]:
    """A published layout's group: ``(strategy, degree, replicas, options)`` or a ``parallel`` mapping."""
    if isinstance(group, dict):
        return dict(group)
    strategy, degree, replicas, options = group
    return {"strategy": strategy, "degree": degree, "replicas": replicas, **options}


def stops_it(row: dict[str, Any], budget: int) -> str:
    """Why a speed row does not fit (empty when it does): its memory against the budget and its
    largest terms, module by module (state, saved activations, gathered weights)."""
    if row["fits"]:
        return ""
    terms = sorted(
        (
            (g.get(f"{kind}_bytes") or 0, f"{m} {label}")
            for m, g in row["groups"].items()
            for kind, label in (("state", "state"), ("activation", "activations"), ("gathered", "gathered"))
        ),
        reverse=True,
    )
    top = ", ".join(f"{name} {b / 1e9:.1f} GB" for b, name in terms[:3] if b)
    total = row["memory_per_gpu"] / 1e9
    return f"out of memory: {total:.1f} GB per GPU > {budget / 1e9:.1f} GB usable ({top})"


def predict_rows(
    lengths: list[int], recipes: list[str], usable: float, calibration: Any = None
) -> dict[str, Any]:
    """The speed rows (every layout, recompute mode, length and recipe) and the longest-fit rows
    (every fit layout and recipe) at ``usable`` of each GPU's memory."""
    from disagg.bench.published_fit import fit_table
    from disagg.plugins import get_registry

    strategies = get_registry().strategies
    layouts = {**published.LAYOUTS_32B, **published.third_party_layouts(strategies)}
    budget = published.usable_bytes(usable)
    speed = []
    for recipe in recipes:
        for row in published.predict_published(
            lengths, strategies=strategies, precision=recipe, usable=usable, machine=calibration
        ):
            found = layouts.get(row["layout"])
            parallel = {m: _spec(g) for m, g in found.items()} if found else None
            speed.append(
                {
                    "layout": row["layout"],
                    "parallel": parallel,
                    "recipe": recipe,
                    "usable": usable,
                    "offload": row.get("offload") or _offload(parallel),
                    **{k: v for k, v in row.items() if k not in ("layout", "offload")},
                    "stops_it": stops_it(row, budget),
                }
            )
    # each longest-fit row in the published model's own JSON form (layout, parallel, recipe,
    # offload, usable, memory terms, what stops it)
    fits = [fit.to_dict(usable) for fit in fit_table(budget, strategies, precisions=tuple(recipes))]
    return {
        "model": "Qwen2.5-VL-32B (config values)",
        "gpus": published.PAPER["gpus"],
        "gpu_memory_bytes": published.PAPER["gpu_memory_bytes"],
        "usable": usable,
        "usable_bytes_per_gpu": budget,
        "time_model": calibration.name if calibration is not None else published.CLUSTER,
        "rows": speed,
        "longest_fit": fits,
    }
