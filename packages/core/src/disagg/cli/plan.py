"""``disagg plan CONFIG``: rank parallel layouts by predicted step time; write the best."""

from __future__ import annotations

import argparse

HELP = "choose each module's strategy, degree, replicas and placement from the strategies' cost model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a train config (its parallel section is ignored)")
    parser.add_argument(
        "--cluster",
        default=None,
        help="preset: h100x8 (default), h200x8, cpu, cpu-local (cpu measured now), or a JSON "
        "file from --calibrate",
    )
    parser.add_argument(
        "--calibrate",
        nargs="?",
        const=True,
        default=None,
        metavar="FILE",
        help="measure this machine (a sweep of matmul shapes fitted to the efficiency curve, element-wise "
        "bandwidth, per-layer dispatch, gloo all-reduce latency and bandwidth, Ray call latency with --ray) "
        "over the cluster's figures; save them to FILE if given",
    )
    parser.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="a calibration file (python -m disagg.gpucheck writes one: the time model's terms measured "
        "at the published layouts' shard shapes) in place of a preset; the flags below still override it",
    )
    parser.add_argument("--ray", action="store_true", help="devices and memory from the running Ray cluster")
    for flag, what in (
        ("--gpus", "devices per node"),
        ("--nodes", "nodes"),
        ("--gpu-mem", "memory per device, e.g. 80GiB"),
        ("--intra-bw", "bytes/s a device sends inside a node, e.g. 360GB/s"),
        ("--inter-bw", "bytes/s a device sends across nodes, e.g. 50GB/s"),
        ("--flops", "peak FLOP/s per device, e.g. 989T"),
        ("--mfu", "fraction of the peak the largest matmuls reach (the efficiency curve's top), e.g. 0.8"),
        ("--usable", "fraction of device memory a plan may fill (default 0.9 on GPU presets, 1.0 on CPU)"),
        ("--intra-latency", "seconds per collective message step inside a node (alpha), e.g. 2us"),
        ("--inter-latency", "seconds per collective message step across nodes, e.g. 5us"),
        ("--layer-overhead", "fixed seconds per layer per microbatch (launch/dispatch), e.g. 0.2ms"),
        ("--call-latency", "seconds per driver->actor call / object-store hop, e.g. 0.5ms"),
        ("--mem-bw", "bytes/s element-wise kernels stream (0: not charged), e.g. 3.35TB/s"),
        ("--gemm-ridge", "FLOP/byte below which a matmul is memory-bound (0: never), e.g. 236"),
        ("--gemm-tile", "side of a matmul's output tile (0: no tile quantization), e.g. 128"),
        ("--compute-units", "SMs running attention blocks at once (0: no wave quantization), e.g. 132"),
    ):
        parser.add_argument(flag, default=None, help=what)
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--vision-tokens",
        type=int,
        default=None,
        help="vision tokens per sample: the merged rows the LLM sees, as `disagg data check` prints "
        "them (Qwen2.5-VL: one per 28x28 pixels, 4 patches). Default: the most one image gives under "
        "data.max_pixels, else 1024 patches' worth",
    )
    size.add_argument(
        "--vision-patches",
        type=int,
        default=None,
        help="the vision size in patches per image instead (the positions the vision encoder "
        "attends over: vision tokens x the spatial merge²)",
    )
    parser.add_argument(
        "--audio-tokens",
        type=int,
        default=None,
        help="encoder positions per clip of an audio module (default: the vision patches)",
    )
    parser.add_argument("--text-tokens", type=int, default=128, help="text tokens per sample (default 128)")
    parser.add_argument(
        "--samples", type=int, default=None, help="samples per step (default data.batch_size)"
    )
    parser.add_argument(
        "--recompute",
        action="store_true",
        help="only layouts that recompute activations (parallel.<m>.recompute is searched per module "
        "either way, and written into the plan)",
    )
    parser.add_argument("--placement", choices=["any", "collocated", "disaggregated"], default="any")
    parser.add_argument(
        "--strategies",
        default=None,
        help="comma-separated strategies the plan may use (default: all installed)",
    )
    parser.add_argument(
        "--dominated",
        action="store_true",
        help="also rank the layouts that the same layout with less offload beats (fits and is faster); "
        "never the best, left out by default",
    )
    parser.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    parser.add_argument("--write", default=None, metavar="PLAN_YAML", help="write the best layout here")
    parser.add_argument("--json", default=None, metavar="FILE", help="write every ranked layout as JSON")
    parser.add_argument(
        "--profile", action="store_true", help="measure the top layouts and re-rank by measurement"
    )
    parser.add_argument(
        "--profile-steps", type=int, default=3, help="steps per profiled layout (first: warm-up)"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from disagg.config.errors import ConfigError, Problem
    from disagg.config.load import load_config
    from disagg.config.model_path import with_local_model_paths
    from disagg.plan.explain import json_rows, own_line, table, why, write_plan
    from disagg.plugins import get_registry

    cfg = with_local_model_paths(load_config(args.config, args.overrides))  # hub ids -> snapshot dirs
    registry = get_registry()
    try:
        result, cluster = plan_for_config(cfg, registry, args)
    except ValueError as exc:
        raise ConfigError([Problem("plan", str(exc))]) from None
    if args.profile:
        from disagg.plan.profile import agreement, profile

        before = [x.name() for x in result.ranked[: args.top]]
        measured = profile(
            result,
            cfg,
            registry,
            top=args.top,
            steps=args.profile_steps,
            out_dir=Path(cfg.output_dir) / "plan-profile",
            precision=result.workload.precision or cluster.precision,
        )
        result.ranked = measured + result.ranked[len(measured) :]
        agree = agreement(measured)
        print(table(result, args.top))
        moved = [x.name() for x in measured] != before
        print(
            f"profile: spearman(predicted, measured step time) = {agree['spearman']}; "
            f"{'re-ranked by measurement' if moved else 'measurement keeps the predicted order'}"
        )
    else:
        print(table(result, args.top))
    if result.ranked:
        print("\n".join(why(result)))
    own = _own(cfg, result, registry)
    print(own_line(own, result))
    if args.write and result.ranked:
        print(f"wrote {write_plan(result.best, args.write, result)}")
    if args.json:
        doc = {
            "cluster": cluster.to_dict(),
            "ranked": [x.to_dict() for x in result.ranked],
            "oom": [x.to_dict() for x in result.oom[: args.top]],
            "skipped": result.skipped,
            "own": own.layout.to_dict() if own.layout else {"why": own.why},
        }
        Path(args.json).write_text(json_rows(doc, ("ranked", "oom")))
    return 0 if result.ranked else 1


OVERRIDES = (
    "gpus",
    "nodes",
    "gpu_mem",
    "intra_bw",
    "inter_bw",
    "flops",
    "mfu",
    "usable",
    "intra_latency",
    "inter_latency",
    "layer_overhead",
    "call_latency",
    "mem_bw",
    "gemm_ridge",
    "gemm_tile",
    "compute_units",
)


def plan_for_config(cfg, registry, args):  # type: ignore[no-untyped-def]
    """The plan of ``cfg`` on the cluster ``args`` describe (a ``disagg plan`` namespace)."""
    from disagg.plan.cluster import cluster_from
    from disagg.plan.search import PLACEMENTS, plan
    from disagg.plan.workload import config_families, config_workload

    overrides = {k: getattr(args, k, None) for k in OVERRIDES}
    if getattr(args, "ray", False):
        from disagg.runtime.run import ensure_ray

        ensure_ray(cfg.ray.address, cfg.ray.num_cpus)
    calibrating = getattr(args, "calibrate", None)
    source = args.cluster
    if getattr(args, "calibration", None):
        from disagg.plan.cluster import load_cluster

        if args.cluster or calibrating:
            raise ValueError(
                "--calibration FILE replaces a preset: give it without --cluster and --calibrate"
            )
        source = load_cluster(args.calibration)
    cluster = cluster_from(
        source or ("cpu" if calibrating else None),
        # measured figures first, the command line's on top of them
        None if calibrating else overrides,
        ray_cluster=getattr(args, "ray", False),
    )
    if calibrating:
        from disagg.plan.calibrate import calibrate
        from disagg.plan.cluster import save_cluster

        cluster = calibrate(cluster, ray_calls=getattr(args, "ray", False) or None)
        cluster = cluster_from(cluster, overrides)
        if isinstance(calibrating, str):
            print(f"calibrated: wrote {save_cluster(cluster, calibrating)}")
    work = config_workload(
        cfg,
        vision_tokens=args.vision_tokens,
        vision_patches=getattr(args, "vision_patches", None),
        text_tokens=args.text_tokens,
        samples=args.samples,
        recompute=args.recompute,
        registry=registry,
        audio_tokens=getattr(args, "audio_tokens", None),
    )
    placements = PLACEMENTS if args.placement == "any" else (args.placement,)
    strategies = registry.strategies
    if getattr(args, "strategies", None):
        names = [n.strip() for n in args.strategies.split(",") if n.strip()]
        unknown = sorted(set(names) - set(strategies))
        if unknown:
            raise ValueError(
                f"--strategies: {unknown} not installed; allowed: {', '.join(sorted(strategies))}"
            )
        strategies = {n: c for n, c in strategies.items() if n in names}
    # a layout a less-offloaded twin beats is no alternative to list (disagg.plan.dominance); the
    # MLPs over sequence tiles are searched where nothing fits without them (plan's fallback pass)
    prune = not getattr(args, "dominated", False)
    families = config_families(cfg, registry)
    result = plan(work, cluster, strategies, families, placements, prune=prune, tiles=True)
    return result, cluster


def _own(cfg, result, registry):  # type: ignore[no-untyped-def]
    """The config's own ``parallel`` layout, scored like the candidates."""
    from disagg.plan.own import own_layout

    return own_layout(cfg, result.workload, result.cluster, registry.strategies)
