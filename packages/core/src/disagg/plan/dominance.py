"""Layouts a less-offloaded twin beats, left out of a plan's lists (``plan(..., prune=True)``).

Offload (``offload: optimizer | activations | all``, a backend's own ``offload_optimizer``) moves state
or saved activations to host memory: it buys device memory with exposed seconds. On a GPU cluster
the planner offers it beside every variant it can apply to, so a three-module plan multiplies its
layouts by up to four per module (Qwen2.5-Omni-7B on 2 GPUs: 1.16M layouts, 99% of the fitting
ones offloaded). A layout's *lesser twins* are the same layout with one group's offload lowered
one step (``all`` -> ``activations`` or ``optimizer``, either -> none, ``offload_optimizer`` ->
off), and their lesser twins in turn. A layout is *dominated* when one of its lesser twins fits and
ranks ahead of it (the plan's order: step time, then memory, then name): it is never the best,
and the twin already stands for it in any list of alternatives.

``mlp_tiles`` (the MLPs over sequence tiles, offered by the planner's fallback pass only:
:func:`disagg.plan.search.plan`) is the same kind of knob, memory bought with recomputed MLP
FLOPs: one more step, ``mlp_tiles: auto`` -> untiled, lowered like offload's.

The rule is exact whatever the cost model says about offload: nothing that ranks ahead of every
lesser twin is left out, so the best layout is the same, and the lists kept are the full lists
with the dominated layouts removed, in the same order. Dropping needs no cost-model assumption;
the time it saves needs one observation: a dominated layout's step time already exceeds its
twin's, so its memory need not be counted (:func:`disagg.plan.search.evaluate_layouts`)."""

from __future__ import annotations

from typing import Any

#: the offload values one step below each (``offload: none`` is the key left out)
LOWER = {"all": ("activations", "optimizer"), "activations": ("none",), "optimizer": ("none",)}


def canonical(options: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    """``options`` without the memory keys at their defaults (a strategy may list ``offload:
    none`` where the planner leaves it out)."""
    default = {("offload", "none"), ("offload_optimizer", False), ("mlp_tiles", 1)}
    return tuple((k, v) for k, v in options if (k, v) not in default)


def level(options: tuple[tuple[str, Any], ...]) -> int:
    """Steps above no offload and no tiles at all (``all``: 2)."""
    o = dict(options)
    return (
        {"all": 2, "activations": 1, "optimizer": 1}.get(o.get("offload", "none"), 0)
        + bool(o.get("offload_optimizer"))
        + (o.get("mlp_tiles", 1) != 1)
    )


def lowered(options: tuple[tuple[str, Any], ...]) -> list[tuple[tuple[str, Any], ...]]:
    """The canonical options one offload (or tiles) step below ``options``."""
    o = dict(canonical(options))
    out = []
    for low in LOWER.get(o.get("offload", "none"), ()):
        out.append(canonical(tuple(sorted({**o, "offload": low}.items()))))
    if o.get("offload_optimizer"):
        out.append(canonical(tuple(sorted({**o, "offload_optimizer": False}.items()))))
    if o.get("mlp_tiles", 1) != 1:
        out.append(canonical(tuple(sorted({**o, "mlp_tiles": 1}.items()))))
    return out


def rank_key(layout: Any) -> tuple[float, int, str]:
    """The plan's order: predicted step time (to 1e-12 s), memory, then name."""
    return (round(layout.step_time_s, 12), layout.memory_bytes, layout.name())


def ahead(a: Any, b: Any) -> bool:
    """``rank_key(a) < rank_key(b)``, naming the layouts only on a tie of time and memory."""
    ka, kb = (round(a.step_time_s, 12), a.memory_bytes), (round(b.step_time_s, 12), b.memory_bytes)
    return ka < kb or (ka == kb and a.name() < b.name())


class Twins:
    """Each module's candidates ordered with lesser twins first, and for each evaluated layout
    (candidate indices, placement) the best-ranked fitting layout among it and its lesser twins."""

    def __init__(self, per_module: dict[str, list[tuple[Any, Any]]]):
        # lesser twins first (a stable sort): itertools.product over the indices then visits every
        # lesser twin of a layout before the layout (one index smaller, the others equal)
        self.per_module = {m: sorted(c, key=lambda gc: level(gc[0].options)) for m, c in per_module.items()}
        self.lower: list[list[list[int]]] = []
        for cands in self.per_module.values():
            index = {
                (g.strategy, g.degree, g.replicas, canonical(g.options)): i for i, (g, _) in enumerate(cands)
            }
            self.lower.append(
                [
                    [
                        index[k]
                        for o in lowered(g.options)
                        if (k := (g.strategy, g.degree, g.replicas, o)) in index
                    ]
                    for g, _ in cands
                ]
            )
        self.best: dict[tuple[tuple[int, ...], str], Any] = {}

    def rival(self, idx: tuple[int, ...], placement: str) -> Any:
        """The best-ranked fitting lesser twin of layout ``idx`` in ``placement`` (None: none fits)."""
        found = None
        for pos, i in enumerate(idx):
            for j in self.lower[pos][i]:
                x = self.best.get((idx[:pos] + (j,) + idx[pos + 1 :], placement))
                if x is not None and x is not found and (found is None or ahead(x, found)):
                    found = x
        return found

    def record(self, idx: tuple[int, ...], placement: str, best: Any) -> None:
        if best is not None:
            self.best[(idx, placement)] = best
