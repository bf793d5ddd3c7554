"""The published setting, predicted: Qwen2.5-VL-32B on 8 x H100 (80 GB).

The model is described by its config values only (from the released
``config.json``; no download). The paper reports DHP (Ulysses SP for the vision
encoder + TP for the LLM) at 1.26-1.37x the throughput of uniform TP, and
65k trainable vision tokens where ZeRO-3 ran out of memory at 16k.

Time is a roofline, stated so it can be argued with: each matmul and attention
core a strategy states at the efficiency its shape reaches on the ``h100x8``
preset's curve, and the element-wise bytes at HBM bandwidth
(:mod:`disagg.plan.efficiency`; ``flat=True``: every FLOP at ``MFU`` of the dense
bf16 peak, the model before shapes were counted), plus bytes at NVLink ring
bandwidth, not overlapped (tensor-parallel collectives sit on the critical path);
collocated groups run one after the other on the same GPUs. Every row says the
``parallel.<module>.recompute`` it assumes, for both modules: ``none`` (what
is saved for backward is held) or ``full`` (the usual setting at these
lengths: per layer only its input is kept, plus one layer's activations while
it is recomputed; the replay costs one more forward of FLOPs and the blocks'
forward collectives again, :mod:`disagg.kit.cost.rules`).
"""

from __future__ import annotations

from typing import Any

from disagg.cost import DecoderShape, EncoderShape, predict
from disagg.kit.cost.memory import device_memory

QWEN2_5_VL_32B: dict[str, Any] = {
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3456,
        "num_heads": 16,
        "out_hidden_size": 5120,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "in_chans": 3,
    },
    "text_config": {
        "model_type": "qwen2_5_vl_text",
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
    },
    "tie_word_embeddings": False,
}

#: the family that describes the published model's modules (Family.planning_shape)
FAMILY = "qwen2_5_vl"
#: the paper's layouts per module: (strategy, degree, replicas, options the layout needs),
#: with ZeRO at stage 3 (``disagg.plan.published.named``)
NAMED: dict[str, dict[str, tuple[str, int, int, dict[str, Any]]]] = {
    "uniform_tp": {"vision": ("megatron_tp", 8, 1, {}), "llm": ("megatron_tp", 8, 1, {})},
    "dhp_ulysses_tp": {"vision": ("ulysses", 8, 1, {}), "llm": ("megatron_tp", 8, 1, {})},
    "uniform_zero3": {"vision": ("zero", 1, 8, {"stage": 3}), "llm": ("zero", 1, 8, {"stage": 3})},
}

PAPER = {
    "gpus": 8,
    "gpu_memory_bytes": 80 * 10**9,
    "throughput_dhp_vs_tp": (1.26, 1.37),
    "zero3_oom_vision_tokens": 16 * 1024,
    "dhp_max_vision_tokens": 64 * 1024,  # "65k"
    # the paper's recipe: bf16 weights, gradients and optimizer state (docs/benchmarks.md)
    "precision": "bf16-pure",
}
#: H100 SXM dense bf16 peak, the fraction of it a well-tuned step reaches (the flat model's), NVLink
#: ring bandwidth
PEAK_FLOPS, MFU, LINK_BYTES_PER_S = 989e12, 0.4, 360e9
#: the machine whose efficiency curve charges compute by shape (disagg.plan.cluster.PRESETS)
CLUSTER = "h100x8"
TEXT_TOKENS = 512  # text tokens per sample beside the image
SAMPLES = 8  # one sample per GPU per step

LAYOUTS_32B: dict[str, dict[str, Any]] = {
    "uniform_tp": {
        "vision": {"strategy": "megatron_tp", "degree": 8},
        "llm": {"strategy": "megatron_tp", "degree": 8},
    },
    "dhp_ulysses_tp": {
        "vision": {"strategy": "ulysses", "degree": 8},
        "llm": {"strategy": "megatron_tp", "degree": 8},
    },
    "dhp_ulysses_tp_sp": {
        "vision": {"strategy": "ulysses", "degree": 8},
        "llm": {"strategy": "megatron_tp", "degree": 8, "sequence_parallel": True},
    },
    "uniform_zero3": {
        "vision": {"strategy": "zero", "stage": 3, "replicas": 8},
        "llm": {"strategy": "zero", "stage": 3, "replicas": 8},
    },
}


def _zero_shard(options: dict[str, Any]) -> str:
    return {1: "optimizer", 2: "gradients", 3: "parameters"}[int(options.get("stage", 1))]


def _shard(options: dict[str, Any]) -> str:
    return str(options.get("shard", "none"))


def _unsharded(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k != "shard"}


def _modelled() -> dict[str, Any]:
    from disagg.plan.extended import Traits

    return {
        # TP x CP: megatron-core's CP beside TP, the optimizer sharded over the CP ranks
        "megatron_tp": Traits(tensor_parallel=True, context_parallel="tp"),
        # FSDP + CP: ddp's shard: parameters (FSDP2) over every rank of the group
        "ddp": Traits(context_parallel="fsdp", shard_mode=_shard, replicated=_unsharded),
        "ulysses": Traits(shard_mode=_shard),
        "zero": Traits(shard_mode=_zero_shard),  # DeepSpeed's offload_optimizer
    }


#: the first-party strategies as the planner models ``context_parallel`` and ``offload: optimizer``
#: for them (:class:`disagg.plan.extended.Traits`) until their own cost hooks state the keys
MODELLED: dict[str, Any] = _modelled()


def third_party_layouts(strategies: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``uniform_<name>`` for every installed strategy none of :data:`LAYOUTS_32B` names:
    both modules under it, at degree 8 where its ``check`` accepts that, else 8 replicas."""
    named = {g["strategy"] for layout in LAYOUTS_32B.values() for g in layout.values()}
    out = {}
    for name in sorted(set(strategies) - named):
        cls = strategies[name]
        try:
            wide = not cls.check(None, 8, 1, cls.options_model())
        except Exception:  # a check that needs the family: the data-parallel mesh
            wide = False
        group = {"strategy": name, "degree": 8} if wide else {"strategy": name, "replicas": 8}
        out[f"uniform_{name}"] = {"vision": dict(group), "llm": dict(group)}
    return out


def predict_published(
    vision_tokens: list[int],
    recompute: tuple[str, ...] = ("none", "full"),
    strategies: dict[str, Any] | None = None,
    flat: bool = False,
    precision: str = "bf16",
    usable: float = 0.9,
    machine: Any = None,
) -> list[dict[str, Any]]:
    """One row per recompute mode, layout and vision length: predicted step time,
    tokens/s, memory per GPU (and whether it fits 80 GB), bytes per GPU. Every strategy
    is asked for its own cost (``strategies``: name -> class, default the installed
    ones); a third party's appears as ``uniform_<name>`` (:func:`third_party_layouts`),
    left out where its hook states no cost for a module. ``flat``: every FLOP at ``MFU``
    (the time model before GEMM shapes were counted); ``precision``: the ``train.precision``
    recipe every layout runs; ``usable``: the fraction of each GPU's 80 GB a row may fill."""
    from disagg.plan.cluster import PRESETS
    from disagg.plan.efficiency import compute_seconds
    from disagg.plan.efficiency import flat as flat_curve
    from disagg.plan.published import published_shapes

    if machine is None:  # ``machine``: a calibration (``disagg bench --calibration``) instead
        machine = PRESETS[CLUSTER]
        assert machine.peak_flops == PEAK_FLOPS
    if flat:
        machine = flat_curve(machine, MFU)

    if strategies is None:
        from disagg.plugins import get_registry

        strategies = get_registry().strategies
    layouts = {**LAYOUTS_32B, **third_party_layouts(strategies)}

    vision = published_shapes(QWEN2_5_VL_32B)["vision"]
    rows = []
    for mode, n in ((m, n) for m in recompute for n in vision_tokens):
        llm_len = n // vision.unit + TEXT_TOKENS
        for name, layout in layouts.items():
            costs, seconds = {}, 0.0
            try:
                predicted = predict_groups(layout, n, mode, precision, strategies)
            except ValueError:
                if name in LAYOUTS_32B:
                    raise
                continue  # a third party's strategy that states no cost for this module
            for module, got in predicted.items():
                cost = got.cost
                costs[module] = cost.to_dict()
                seconds += compute_seconds(cost, machine) + cost.comm_bytes / LINK_BYTES_PER_S
            device = device_memory([g.memory for g in predicted.values()])
            memory = device.total
            if len(costs) < 2:
                continue
            tokens = SAMPLES * llm_len
            rows.append(
                {
                    "layout": name,
                    "recompute": mode,
                    "vision_tokens": n,
                    "step_time_s": seconds,
                    "tokens_per_s": tokens / seconds,
                    "memory_per_gpu": memory,
                    "fits": memory <= usable_bytes(usable),
                    "groups": costs,
                }
            )
    return rows


def usable_bytes(usable: float = 0.9) -> int:
    """What a GPU of the published setting may fill: its 80 GB times ``usable`` (headroom kept
    beyond what the memory model counts: the CUDA contexts, NCCL buffers, the step's transient
    and fragmentation are counted, :mod:`disagg.kit.cost.memory`; default 0.9)."""
    if not 0 < usable <= 1:
        raise ValueError(f"--usable {usable}: a fraction of device memory in (0, 1]")
    return int(PAPER["gpu_memory_bytes"] * usable)


def predict_layout(
    layout: dict[str, dict[str, Any]],
    n: int,
    recompute: str,
    precision: str,
    strategies: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Each module's :class:`~disagg.interfaces.Cost` under ``layout`` (module -> its
    ``parallel.<module>`` keys) at ``n`` vision tokens per image, as the published rows ask
    (8 samples, one per replica per microbatch, ``recompute`` in both modules); a strategy
    that states no cost for a module is a ``ValueError``."""
    return {m: g.cost for m, g in predict_groups(layout, n, recompute, precision, strategies).items()}


def predict_groups(
    layout: dict[str, dict[str, Any]],
    n: int,
    recompute: str,
    precision: str,
    strategies: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """:func:`predict_layout` with each group's allocator view and offload
    (:class:`disagg.plan.extended.GroupCost`): ``context_parallel`` and ``offload`` keys included."""
    from dataclasses import replace

    from disagg.plan.extended import extended_cost
    from disagg.plan.published import published_shapes

    shapes = published_shapes(QWEN2_5_VL_32B)
    vision, llm = shapes["vision"], shapes["llm"]
    assert isinstance(vision, EncoderShape) and isinstance(llm, DecoderShape)
    out = {}
    for module, shape, seq in (("vision", vision, n), ("llm", llm, n // vision.unit + TEXT_TOKENS)):
        g = layout[module]
        degree, replicas = int(g.get("degree", 1)), int(g.get("replicas", 1))
        width = None if module == "vision" else vision.out_hidden

        def ask(
            *,
            shape,
            degree,
            replicas,
            seq_len,
            samples,
            options,
            recompute,
            exchanged_rows,
            _s=g["strategy"],
            _w=width,
        ):
            return predict(
                shape,
                _s,
                degree,
                replicas,
                seq_len,
                precision,
                samples=samples,
                microbatches=samples // replicas,  # one sample per replica per microbatch
                options=options,
                recompute=recompute,
                strategies=strategies,
                exchanged_rows=exchanged_rows,
                exchanged_width=_w,
            )

        got = extended_cost(
            ask,
            shape,
            MODELLED.get(g["strategy"]),
            degree,
            replicas,
            seq,
            precision,
            SAMPLES,
            SAMPLES // replicas,
            {k: v for k, v in g.items() if k not in ("strategy", "degree", "replicas")},
            recompute,
            None if module == "vision" else n // vision.unit,
        )
        got.memory = replace(got.memory, module=module)
        out[module] = got
    return out


def ratios(rows: list[dict[str, Any]], recompute: str = "full") -> list[dict[str, Any]]:
    """Per vision length, under ``recompute``: predicted DHP / TP throughput and who fits 80 GB."""
    by = {(r["layout"], r["vision_tokens"]): r for r in rows if r.get("recompute", recompute) == recompute}
    out = []
    for n in sorted({r["vision_tokens"] for r in rows}):
        tp, dhp = by[("uniform_tp", n)], by[("dhp_ulysses_tp", n)]
        out.append(
            {
                "vision_tokens": n,
                "recompute": recompute,
                "throughput_dhp_vs_tp": dhp["tokens_per_s"] / tp["tokens_per_s"],
                "throughput_dhp_sp_vs_tp": by[("dhp_ulysses_tp_sp", n)]["tokens_per_s"] / tp["tokens_per_s"],
                "fits": {name: by[(name, n)]["fits"] for name in LAYOUTS_32B},
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m disagg.bench.published [LENGTHS] [--precision P,..] [--usable F,..] [--flat] [--json]``:
    per vision length, recipe and usable fraction, each DHP layout against the best homogeneous
    layout the planner finds on the same 8 GPUs, like for like (:mod:`disagg.bench.published_compare`),
    the paper's own comparison in its precision as a row of its own, the goals met or not; then the
    longest vision sequence that fits per layout and recipe (:mod:`disagg.bench.published_fit`)."""
    import argparse

    from disagg.bench.data import parse_tokens
    from disagg.bench.json_out import print_json
    from disagg.bench.published_compare import compare_md, goal_lines, paper_md, run
    from disagg.bench.published_fit import FIT_RECIPES, fit_goal_lines, fit_md, fit_table
    from disagg.plan.cluster import PRESETS
    from disagg.plan.efficiency import flat as flat_curve

    p = argparse.ArgumentParser(prog="python -m disagg.bench.published", description=main.__doc__)
    p.add_argument("lengths", nargs="?", default="16k,64k,128k", help="vision tokens per image")
    p.add_argument("--flat", action="store_true", help="every FLOP at MFU (the model before GEMM shapes)")
    p.add_argument("--precision", default="bf16", help="train.precision recipes compared, comma-separated")
    p.add_argument(
        "--usable", default="0.9", help="fractions of each GPU's memory a layout may fill, comma-separated"
    )
    p.add_argument("--fit-precisions", default=",".join(FIT_RECIPES), help="recipes of the longest-fit table")
    p.add_argument("--json", action="store_true", help="the comparison as JSON (every row, every table)")
    args = p.parse_args(argv)
    usables = [float(x) for x in args.usable.split(",") if x.strip()]
    for u in usables:
        usable_bytes(u)  # a clear error before any search
    precisions = [x.strip() for x in args.precision.split(",") if x.strip()]
    cluster = flat_curve(PRESETS[CLUSTER], MFU) if args.flat else PRESETS[CLUSTER]
    fit_recipes = tuple(x.strip() for x in args.fit_precisions.split(",") if x.strip())

    def tables() -> tuple[dict[str, Any], dict[float, Any]]:
        out = run(parse_tokens(args.lengths), precisions, usables, cluster)
        return out, {u: fit_table(usable_bytes(u), precisions=fit_recipes) for u in usables}

    if args.json:

        def answer() -> dict[str, Any]:
            out, fits = tables()
            out["fits"] = [f.to_dict(u) for u, rows in fits.items() for f in rows]
            out["fit_goals"] = [line for u, rows in fits.items() for line in fit_goal_lines(rows, u)]
            return out

        print_json(answer, indent=1)
        return 0
    out, fits = tables()
    print(f"compute: {'every FLOP at MFU ' + str(MFU) if args.flat else 'by GEMM shape on ' + CLUSTER}\n")
    for t in out["tables"]:
        print(compare_md(t), "\n")
    print(paper_md(out["paper"]), "\n")
    print("\n".join(goal_lines(out["tables"])), "\n")
    for u, rows in fits.items():
        print(fit_md(rows, usable_bytes(u), PAPER, usable=u))
        print("\n".join(fit_goal_lines(rows, u)), "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
