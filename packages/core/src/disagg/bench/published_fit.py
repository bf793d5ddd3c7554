"""The published setting's longest trainable vision sequence, per layout and precision recipe.

Qwen2.5-VL-32B on 8 GPUs of 80 GB (:mod:`disagg.bench.published`), 8 samples of one image +
512 text tokens, ``recompute: full`` in every module, like for like:

- ``dhp_sp``: DHP with sequence parallelism, ``ulysses`` 8 for the tower with its state sharded
  (``shard: parameters``) + ``megatron_tp`` 8 with sequence parallelism for the LLM;
- ``tp_sp``: uniform ``megatron_tp`` 8 with sequence parallelism in both (its like-for-like baseline);
- ``dhp``: ``ulysses`` 8 (``shard: parameters``) + ``megatron_tp`` 8 without sequence parallelism;
- ``tp``: uniform ``megatron_tp`` 8 without it;
- ``zero3``: uniform ``zero`` stage 3 over 8 data-parallel ranks.

For each recipe (``train.precision``: ``fp32``, ``bf16`` with fp32 masters, ``bf16-pure``) the longest
vision length, in steps of 1k tokens, whose memory per GPU (every group's state + gathered
parameters + saved activations, :attr:`disagg.interfaces.Cost.memory_bytes`) fits the usable
memory (``device memory x usable``). Only what training does is predicted: where a layout's
strategy does not honour the recipe (:attr:`Strategy.precisions`, refused at validation) the cell
says so instead of a length. A layout that fits no length says why: its memory at the shortest
length and the largest terms of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

from disagg.bench.fit_search import longest_fitting
from disagg.interfaces import Cost
from disagg.kit.cost.memory import DeviceMemory, device_memory
from disagg.kit.cost.offload import HOST_MEMORY_BYTES

#: GPUs of one node sharing its host memory (the published setting: one 8-GPU node)
GPUS_PER_NODE = 8

#: the paper's layouts, like for like (module docstring)
FIT_LAYOUTS: dict[str, dict[str, dict[str, Any]]] = {
    "dhp_sp": {
        "vision": {"strategy": "ulysses", "degree": 8, "shard": "parameters"},
        "llm": {"strategy": "megatron_tp", "degree": 8, "sequence_parallel": True},
    },
    "tp_sp": {
        "vision": {"strategy": "megatron_tp", "degree": 8, "sequence_parallel": True},
        "llm": {"strategy": "megatron_tp", "degree": 8, "sequence_parallel": True},
    },
    "dhp": {
        "vision": {"strategy": "ulysses", "degree": 8, "shard": "parameters"},
        "llm": {"strategy": "megatron_tp", "degree": 8},
    },
    "tp": {
        "vision": {"strategy": "megatron_tp", "degree": 8},
        "llm": {"strategy": "megatron_tp", "degree": 8},
    },
    "zero3": {
        "vision": {"strategy": "zero", "stage": 3, "replicas": 8},
        "llm": {"strategy": "zero", "stage": 3, "replicas": 8},
    },
    # context parallelism for the LLM (TP x CP; FSDP + CP), the tower under Ulysses 8
    "dhp_tp4_cp2": {
        "vision": {"strategy": "ulysses", "degree": 8, "shard": "parameters"},
        "llm": {"strategy": "megatron_tp", "degree": 4, "sequence_parallel": True, "context_parallel": 2},
    },
    "dhp_tp2_cp4": {
        "vision": {"strategy": "ulysses", "degree": 8, "shard": "parameters"},
        "llm": {"strategy": "megatron_tp", "degree": 2, "sequence_parallel": True, "context_parallel": 4},
    },
    "dhp_fsdp_cp8": {
        "vision": {"strategy": "ulysses", "degree": 8, "shard": "parameters"},
        "llm": {"strategy": "ddp", "shard": "parameters", "context_parallel": 8},
    },
    # homogeneous FSDP: the tower data parallel (it cannot split its sequence under ddp), the LLM + CP 8
    "fsdp_cp8": {
        "vision": {"strategy": "ddp", "shard": "parameters", "replicas": 8},
        "llm": {"strategy": "ddp", "shard": "parameters", "context_parallel": 8},
    },
}
#: ``train.precision`` recipes, each alone, with ``offload: optimizer`` in every group (``+offload``)
#: and with ``offload: all`` (the optimizer and recompute's saved block inputs, ``+all``); the last
#: two also with every group's MLPs in sequence tiles (``+tiles``: :data:`FIT_TILES`)
FIT_RECIPES = (
    "fp32",
    "bf16",
    "bf16+offload",
    "bf16+all",
    "bf16+all+tiles",
    "bf16-pure",
    "bf16-pure+offload",
    "bf16-pure+all",
    "bf16-pure+all+tiles",
)
#: a column's suffix -> ``parallel.<module>.offload``
OFFLOAD_COLUMNS = {"": "none", "offload": "optimizer", "all": "all"}
#: a column's ``+tiles``: ``parallel.<module>.mlp_tiles`` in every group (ALST's rule: ``auto``, a tile
#: of about ``hidden`` rows; :mod:`disagg.kit.recompute.tiled_mlp`)
TILES_COLUMN, FIT_TILES = "tiles", "auto"


def recipe_of(column: str) -> tuple[str, str]:
    """``bf16+offload`` -> (``bf16``, ``optimizer``); ``bf16-pure+all`` -> (``bf16-pure``, ``all``);
    a ``+tiles`` is read by :func:`tiles_of`."""
    precision, *extras = column.split("+")
    extras = [x for x in extras if x != TILES_COLUMN]
    if len(extras) > 1 or (extras and extras[0] not in OFFLOAD_COLUMNS):
        raise ValueError(f"{column!r}: a recipe, optionally +offload or +all, optionally +tiles")
    return precision, OFFLOAD_COLUMNS[extras[0] if extras else ""]


def tiles_of(column: str) -> int | str:
    """``parallel.<module>.mlp_tiles`` of a column: :data:`FIT_TILES` with ``+tiles``, else 1."""
    return FIT_TILES if TILES_COLUMN in column.split("+")[1:] else 1


def with_tiles(layout: dict[str, dict[str, Any]], column: str) -> dict[str, dict[str, Any]]:
    """Every group of ``layout`` with the column's ``mlp_tiles`` (as it is without ``+tiles``)."""
    tiles = tiles_of(column)
    return {m: {**g, "mlp_tiles": tiles} for m, g in layout.items()} if tiles != 1 else layout


def tiles_refusal(layout: dict[str, dict[str, Any]], strategies: dict[str, Any]) -> str:
    """Why a layout cannot tile its MLPs ('' when every group's strategy can), as validation would
    refuse it (:mod:`disagg.config.model_checks`: ``mlp_tiles_support``)."""
    for module, group in layout.items():
        if group.get("mlp_tiles", 1) == 1:
            continue
        cls = strategies.get(group["strategy"])
        if cls is not None and not getattr(cls, "mlp_tiles_support", False):
            return (
                f"{group['strategy']} ({module}) does not run sequence-tiled MLPs "
                f"(parallel.{module}.mlp_tiles refused at validation): not predicted"
            )
    return ""


def with_offload(layout: dict[str, dict[str, Any]], offload: str) -> dict[str, dict[str, Any]]:
    """Every group of ``layout`` with ``offload`` (``none``: as it is)."""
    return {m: {**g, "offload": offload} for m, g in layout.items()} if offload != "none" else layout


#: the search's step and ceiling, vision tokens per image
STEP, CEILING = 1024, 2 * 1024 * 1024


@dataclass
class Fit:
    """One layout under one recipe."""

    layout: str
    precision: str
    #: the longest vision length that fits (0: none; None: not predicted, see ``reason``)
    longest: int | None
    #: memory per GPU at ``longest`` (or, where nothing fits, at the shortest length)
    memory_bytes: int = 0
    #: why nothing longer (or nothing at all) fits, or why the recipe is not predicted
    reason: str = ""
    #: every group's cost at the length ``memory_bytes`` is for
    costs: dict[str, Cost] = field(default_factory=dict, repr=False)
    #: the device's terms at that length
    view: DeviceMemory | None = field(default=None, repr=False)
    #: the largest term one step longer (what stops it; '' at the ceiling or when not predicted)
    stopped_by: str = ""
    #: the step's seconds at ``longest`` (:func:`step_seconds`), offload's exposed seconds apart
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self, usable: float | None = None) -> dict[str, Any]:
        recipe, offload = recipe_of(self.precision)
        host = None if self.view is None else self.view.host_per_device * GPUS_PER_NODE
        return {
            "layout": self.layout,
            "parallel": FIT_LAYOUTS.get(self.layout),
            "recipe": recipe,
            "offload": offload,
            # parallel.<module>.mlp_tiles in every group (1: off)
            "mlp_tiles": tiles_of(self.precision),
            "usable": usable,
            "longest_vision_tokens": self.longest,
            "memory_bytes": self.memory_bytes,
            "memory_terms": {} if self.view is None else dict(self.view.terms),
            "host_bytes_per_node": host,
            "host_fits": None if host is None else host <= HOST_MEMORY_BYTES,
            "stopped_by": self.stopped_by,
            "reason": self.reason,
            "step_seconds": dict(self.seconds),
        }


def refusal(layout: dict[str, dict[str, Any]], precision: str, strategies: dict[str, Any]) -> str:
    """Why ``layout`` cannot run ``precision`` ('' when every strategy honours it): the recipe is
    not one the strategy honours, or its own precision checks refuse the options under it (as
    validation would, e.g. ``zero``'s offloaded optimizer under ``bf16-pure``) — a table must not
    predict a layout the config would refuse."""
    from disagg.plan.search import precision_refusal

    precision, offload = recipe_of(precision)
    for module, group in with_offload(layout, offload).items():
        cls = strategies.get(group["strategy"])
        if cls is None:
            return f"strategy {group['strategy']!r} ({module}) is not installed"
        honoured = tuple(getattr(cls, "precisions", ("fp32",)))
        if precision not in honoured:
            return (
                f"{group['strategy']} ({module}) does not honour train.precision {precision} "
                f"(it honours {', '.join(honoured)}): not predicted"
            )
        fields = cls.options_model.model_fields
        given = {k: v for k, v in group.items() if k in fields}
        if "recompute" in fields:
            given.setdefault("recompute", "full")  # every published row recomputes in full
        problem = precision_refusal(cls, cls.options_model(**given), precision, module)
        if problem:
            return f"{group['strategy']} ({module}) refused: {problem}: not predicted"
    return ""


def memory(
    layout: dict[str, dict[str, Any]], n: int, precision: str, strategies: dict[str, Any]
) -> tuple[int, dict[str, Cost]]:
    """Memory per GPU of the collocated ``layout`` at ``n`` vision tokens as the allocator holds
    it (:func:`device`), and each group's cost; ``precision`` may carry ``+offload``."""
    view, costs = device(layout, n, precision, strategies)
    return view.total, costs


def device(
    layout: dict[str, dict[str, Any]], n: int, precision: str, strategies: dict[str, Any]
) -> tuple[DeviceMemory, dict[str, Cost]]:
    """The device's peak by term (:func:`disagg.kit.cost.memory.device_memory`) and each group's cost."""
    view, groups = device_groups(layout, n, precision, strategies)
    return view, {m: g.cost for m, g in groups.items()}


def device_groups(
    layout: dict[str, dict[str, Any]], n: int, precision: str, strategies: dict[str, Any]
) -> tuple[DeviceMemory, dict[str, Any]]:
    """:func:`device`, with each group's :class:`~disagg.plan.extended.GroupCost`."""
    from disagg.bench.published import predict_groups

    recipe, offload = recipe_of(precision)
    layout = with_tiles(layout, precision)
    groups = predict_groups(with_offload(layout, offload), n, "full", recipe, strategies)
    return device_memory([g.memory for g in groups.values()]), groups


def step_seconds(groups: dict[str, Any]) -> dict[str, float]:
    """The published table's step time of ``groups`` (compute by shape on ``h100x8`` + collective
    bytes over the link, :func:`disagg.bench.published.predict_published`'s rule) and what offload
    adds on the critical path: the host AdamW's exposed seconds and the saved inputs' copies
    (:mod:`disagg.kit.cost.activation_offload`: all of it, on the compute stream)."""
    from disagg.bench.published import CLUSTER, LINK_BYTES_PER_S
    from disagg.kit.cost.activation_offload import offload_seconds as act_seconds
    from disagg.kit.cost.offload import offload_seconds
    from disagg.plan.cluster import PRESETS
    from disagg.plan.efficiency import compute_seconds

    machine = PRESETS[CLUSTER]
    out = {"compute_comm_s": 0.0, "optimizer_offload_s": 0.0, "activation_offload_s": 0.0}
    for g in groups.values():
        compute = compute_seconds(g.cost, machine)
        out["compute_comm_s"] += compute + g.cost.comm_bytes / LINK_BYTES_PER_S
        if g.offload is not None:
            out["optimizer_offload_s"] += offload_seconds(compute_s=compute, **g.offload)["exposed_s"]
        if g.activation_offload is not None:
            out["activation_offload_s"] += act_seconds(**g.activation_offload)["exposed_s"]
    out["step_time_s"] = sum(out.values())
    return out


def terms(costs: dict[str, Cost] | DeviceMemory) -> list[tuple[str, int]]:
    """A layout's memory per GPU by module and kind (or a device's terms), largest first."""
    if isinstance(costs, DeviceMemory):
        return costs.largest(len(costs.terms))
    out = []
    for m, c in costs.items():
        for kind, v in (
            ("state", c.state_bytes),
            ("gathered", c.gathered_bytes),
            ("activations", c.activation_bytes),
            ("buffers", c.buffer_bytes),  # e.g. ZeRO-3's reduce bucket, ddp's gradient bucket
        ):
            if v:
                out.append((f"{m} {kind}", v))
    return sorted(out, key=lambda kv: -kv[1])


def _why(total: int, budget: int, costs: dict[str, Cost] | DeviceMemory, n: int) -> str:
    parts = ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in terms(costs)[:3])
    return f"at {n // 1024}k: {total / 1e9:.1f} GB per GPU > {budget / 1e9:.1f} GB usable ({parts})"


def longest_fit(
    name: str, precision: str, budget: int, strategies: dict[str, Any], ceiling: int = CEILING
) -> Fit:
    """The longest vision length of ``FIT_LAYOUTS[name]`` under ``precision`` within ``budget``
    bytes per GPU, in steps of :data:`STEP` up to ``ceiling`` (memory grows with the length:
    :func:`~disagg.bench.fit_search.longest_fitting`; a layout that fits at the ceiling says so)."""
    layout = with_tiles(FIT_LAYOUTS[name], precision)
    refused = refusal(layout, precision, strategies) or tiles_refusal(layout, strategies)
    if refused:
        return Fit(name, precision, None, reason=refused)

    @cache  # the search and the reasons below ask for the same lengths
    def at(k: int) -> tuple[DeviceMemory, dict[str, Cost]]:
        view, groups = device_groups(layout, k * STEP, precision, strategies)
        speeds[k] = groups
        return view, {m: g.cost for m, g in groups.items()}

    speeds: dict[int, dict[str, Any]] = {}

    def fit(k: int, reason: str, view: DeviceMemory, costs: dict[str, Cost], why: DeviceMemory | None) -> Fit:
        stop = "" if why is None else why.largest(1)[0][0]
        f = Fit(name, precision, k, view.total, reason, costs, view, stop)
        f.seconds = step_seconds(speeds[max(1, k // STEP)])
        return f

    def fits(view: DeviceMemory) -> bool:  # the device, and the node's host memory (offload)
        return view.total <= budget and view.host_per_device * GPUS_PER_NODE <= HOST_MEMORY_BYTES

    cap = ceiling // STEP
    k = longest_fitting(lambda k: fits(at(k)[0]), cap)
    if k == 0:
        view, costs = at(1)
        return fit(0, "out of memory " + _why(view.total, budget, view, STEP), view, costs, view)
    view, costs = at(k)
    if k == cap:
        return fit(k * STEP, f"fits up to the search's ceiling ({ceiling // 1024}k)", view, costs, None)
    over, _ = at(k + 1)
    if over.total <= budget:  # the host memory stops it
        host = over.host_per_device * GPUS_PER_NODE
        f = fit(
            k * STEP,
            f"next step at {k + 1}k: {host / 1e12:.2f} TB of host memory per node > "
            f"{HOST_MEMORY_BYTES / 1e12:.1f} TB",
            view,
            costs,
            None,
        )
        f.stopped_by = "host memory"
        return f
    return fit(k * STEP, "next step " + _why(over.total, budget, over, (k + 1) * STEP), view, costs, over)


def fit_table(
    budget: int,
    strategies: dict[str, Any] | None = None,
    precisions: tuple[str, ...] = FIT_RECIPES,
    layouts: tuple[str, ...] = tuple(FIT_LAYOUTS),
) -> list[Fit]:
    """:func:`longest_fit` for every layout and recipe (``strategies``: default the installed)."""
    if strategies is None:
        from disagg.plugins import get_registry

        strategies = get_registry().strategies
    return [longest_fit(name, p, budget, strategies) for name in layouts for p in precisions]


def fit_md(fits: list[Fit], budget: int, paper: dict[str, Any], usable: float | None = None) -> str:
    """The table: a row per layout, a column per recipe; then each cell's reason. ``usable``:
    the fraction of the GPU's memory ``budget`` is (stated in the heading)."""
    precisions = list(dict.fromkeys(f.precision for f in fits))
    by = {(f.layout, f.precision): f for f in fits}

    def cell(f: Fit) -> str:
        if f.longest is None:
            return "not predicted"
        if f.longest == 0:
            return "OOM at 1k"
        return f"{f.longest // 1024}k ({f.memory_bytes / 1e9:.1f} GB)"

    lines = [
        f"Longest vision sequence per image that fits {budget / 1e9:.1f} GB per GPU"
        + ("" if usable is None else f" (usable {usable:.2f} of {paper['gpu_memory_bytes'] / 1e9:.0f} GB)")
        + " (Qwen2.5-VL-32B, 8 GPUs, "
        f"recompute: full; the paper: DHP {paper['dhp_max_vision_tokens'] // 1024}k, ZeRO-3 out of memory "
        f"at {paper['zero3_oom_vision_tokens'] // 1024}k)",
        "",
        "| layout | " + " | ".join(f"`{p}`" for p in precisions) + " |",
        "|---|" + "---|" * len(precisions),
    ]
    for name in dict.fromkeys(f.layout for f in fits):
        lines.append(f"| {name} | " + " | ".join(cell(by[(name, p)]) for p in precisions) + " |")
    lines.append("")
    lines += [f"- {f.layout} / `{f.precision}`: {f.reason}" for f in fits if f.reason]
    return "\n".join(lines)


#: the project's goals for the longest fit (issue 39: printed for the record, never asserted on the
#: the project's goals (issue 38), printed met / not met for the record (not asserted on the model's
#: own output): the best DHP layout (any ``dhp*`` row: Ulysses tower, the LLM under TP, TP x CP or
#: FSDP + CP) trains 128k vision tokens with fp32 masters (``bf16`` + optimizer offload) and
#: 1,000,000 under ``bf16-pure``
FIT_GOALS: tuple[tuple[str, str, int], ...] = (
    ("dhp", "bf16+offload", 128 * 1024),
    ("dhp", "bf16-pure", 1_000_000),
    ("dhp", "bf16-pure+offload", 1_000_000),
    ("dhp", "bf16-pure+all", 1_000_000),
    ("dhp", "bf16-pure+all+tiles", 1_000_000),
)


def fit_goal_lines(fits: list[Fit], usable: float) -> list[str]:
    """Each of :data:`FIT_GOALS` met or not by the predicted table (the best row whose name starts
    with the goal's prefix), for the record."""
    out = []
    for prefix, precision, tokens in FIT_GOALS:
        rows = [f for f in fits if f.layout.startswith(prefix) and f.precision == precision]
        rows = [f for f in rows if f.longest is not None]
        if not rows:
            continue
        f = max(rows, key=lambda f: f.longest or 0)
        met = bool(f.longest) and f.longest >= tokens
        got = f"{f.longest // 1024}k ({f.layout})" if f.longest else f"OOM at 1k ({f.layout})"
        stop = f"; stopped by {f.stopped_by}" if f.stopped_by and not met else ""
        out.append(
            f"goal: DHP fits {tokens:,} vision tokens under `{precision}` (usable {usable:.2f}): "
            f"{'met' if met else 'not met'} (predicted {got}{stop})"
        )
    return out
