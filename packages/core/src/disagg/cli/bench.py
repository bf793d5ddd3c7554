"""``disagg bench CONFIG``: parallel layouts swept over vision lengths, measured
beside the analytic model, with the published setting predicted."""

from __future__ import annotations

import argparse
from typing import Any

HELP = "sweep parallel layouts over vision lengths; measured vs analytic bytes, memory, throughput, plots"

_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
#: vision lengths of the published-setting prediction, unless ``--predict`` names others
PREDICT_LENGTHS = "4k,16k,64k"


def parse_bytes(text: str) -> int:
    """``"96MiB"``, ``"1.5g"``, ``"100000000"`` -> bytes (binary units)."""
    import re

    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (e.g. 64MiB, 2G, 100000000)")
    try:
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size in bytes (e.g. 64MiB, 2G, 100000000)"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        nargs="?",
        default=None,
        help="a train config (model, data, train); its parallel and data sections are replaced "
        "(not needed with --predict --json)",
    )
    parser.add_argument(
        "--preset",
        default="paper",
        help="layouts to compare (default: paper = uniform_tp, "
        "dhp_ulysses_tp, dhp_ulysses_tp_sp, dhp_ulysses_tp_sp_recompute, uniform_zero3)",
    )
    parser.add_argument(
        "--layouts", default=None, metavar="FILE", help="YAML file of named layouts instead of --preset"
    )
    parser.add_argument(
        "--degree",
        type=int,
        default=None,
        help="SP/TP degree (and ZeRO ranks) of the preset's groups (default 2); with --layouts, "
        "the d of its targets (default: the largest group's ranks)",
    )
    parser.add_argument(
        "--vision-tokens", default="256,1k", help="vision lengths (patches per image), e.g. 1k,4k,16k"
    )
    parser.add_argument("--samples", type=int, default=None, help="samples per step (default: the degree)")
    parser.add_argument("--steps", type=int, default=4, help="steps per point; the first is warm-up")
    parser.add_argument(
        "--mem-budget",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="find each layout's longest vision sequence whose saved activations + state "
        "per rank fit (bisection with real steps), e.g. 64MiB",
    )
    parser.add_argument(
        "--max-vision-tokens",
        default=None,
        help="longest length the budget search may try (default: 4 x the longest of --vision-tokens)",
    )
    parser.add_argument(
        "--predict",
        nargs="?",
        const=PREDICT_LENGTHS,
        default=PREDICT_LENGTHS,
        metavar="TOKENS",
        help="vision lengths for the published Qwen2.5-VL-32B / 8-GPU prediction ('none' skips it; "
        f"default {PREDICT_LENGTHS})",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="with --predict: print the model's published-setting rows as JSON (each with its layout, "
        "recipe, usable fraction and offload) and run nothing",
    )
    parser.add_argument(
        "--precision",
        default="bf16",
        help="with --predict --json: train.precision recipes of the rows, comma-separated (default bf16)",
    )
    parser.add_argument(
        "--usable",
        type=float,
        default=0.9,
        metavar="FRACTION",
        help="fraction of each GPU's memory a predicted layout of the published setting may fill "
        "(default 0.9; the allocator's terms are counted on top of the tensors)",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="predict the runs' step times on this machine measured now (disagg plan --calibrate's "
        "sweep) instead of the cpu preset (or the --calibration file)",
    )
    parser.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="predict the published setting with this calibration file (python -m disagg.gpucheck) "
        "in place of the h100x8 preset, and the runs' step times with it unless --calibrate",
    )
    parser.add_argument(
        "--feature-cache",
        default=None,
        metavar="KINDS",
        help="instead of the sweep: the config's own layout with a frozen tower, 2 epochs with "
        "parallel.vision.feature_cache (host, disk or host,disk) and without; epoch 2's step time "
        "ratio beside the planner's, bytes per cached sample (disagg.bench.feature_cache)",
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=None, help="output dir (default: OUTPUT_DIR/bench)")


def _problem(key: str, message: str) -> Exception:
    from disagg.config.errors import ConfigError, Problem

    return ConfigError([Problem(key, message)])


def _calibration(args: argparse.Namespace) -> Any:
    if not getattr(args, "calibration", None):
        return None
    from disagg.plan.cluster import load_cluster

    try:
        return load_cluster(args.calibration)
    except ValueError as exc:
        raise _problem("--calibration", str(exc)) from None


def predict_json(args: argparse.Namespace) -> int:
    """``--predict --json``: the model's rows, nothing run."""
    from disagg.bench.data import parse_tokens
    from disagg.bench.json_out import print_json
    from disagg.bench.predict_rows import predict_rows
    from disagg.interfaces.precision import RECIPES

    try:
        lengths = parse_tokens(args.predict)
    except ValueError as exc:
        raise _problem("--predict", str(exc)) from None
    recipes = [x.strip() for x in args.precision.split(",") if x.strip()]
    bad = [r for r in recipes if r not in RECIPES]
    if bad or not recipes:
        raise _problem("--precision", f"{bad or args.precision!r}; allowed: {', '.join(RECIPES)}")
    calibration = _calibration(args)
    print_json(lambda: predict_rows(lengths, recipes, args.usable, calibration), indent=1, default=str)
    return 0


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    if not 0 < args.usable <= 1:
        raise _problem("--usable", f"{args.usable} is not a fraction of device memory in (0, 1]")
    if args.json:
        if args.predict.strip().lower() == "none":
            raise _problem("--json", "prints the --predict rows: give --predict [TOKENS], not none")
        return predict_json(args)
    if args.config is None:
        raise _problem("config", "a train config is needed to run layouts (only --predict --json runs none)")
    if args.feature_cache:
        return feature_cache(args)

    from disagg.bench.plots import require_matplotlib

    require_matplotlib()
    from disagg.bench.data import parse_tokens
    from disagg.bench.output import write_outputs
    from disagg.bench.presets import PRESETS, largest_group, load_layouts
    from disagg.bench.runner import Progress
    from disagg.bench.sweep import Bench
    from disagg.config.errors import ConfigError, Problem
    from disagg.config.load import load_config
    from disagg.config.model_path import with_local_model_paths
    from disagg.plugins import get_registry

    cfg = with_local_model_paths(load_config(args.config, args.overrides))  # hub ids -> snapshot dirs
    modules = cfg.modules()
    if args.layouts:
        layouts = load_layouts(args.layouts, modules)
        degree = args.degree or largest_group(layouts)
    elif args.preset in PRESETS:
        degree = args.degree or 2
        layouts = PRESETS[args.preset](degree, modules)
    else:
        raise ConfigError(
            [Problem("--preset", f"unknown preset {args.preset!r}; allowed: {', '.join(PRESETS)}")]
        )
    try:
        lengths = parse_tokens(args.vision_tokens)
        predict_lengths = [] if args.predict.strip().lower() == "none" else parse_tokens(args.predict)
    except ValueError as exc:
        raise ConfigError([Problem("--vision-tokens", str(exc))]) from None
    calibration = _calibration(args)
    max_tokens = None
    if args.max_vision_tokens is not None:  # same spelling as --vision-tokens: 8k, 16384
        try:
            (max_tokens,) = parse_tokens(args.max_vision_tokens)
        except ValueError as exc:
            raise ConfigError([Problem("--max-vision-tokens", f"one length, e.g. 8k: {exc}")]) from None
    precision = cfg.train.precision
    if precision == "auto":  # one recipe for every layout, decided once, by the cluster's devices
        precision = _cluster_precision(cfg, layouts)
    out = Path(args.out) if args.out else Path(cfg.output_dir) / "bench"
    out.mkdir(parents=True, exist_ok=True)
    extra = 0
    if args.mem_budget is not None:
        extra = 2 * len(layouts)  # up to two probe runs per layout, for the time estimate
    try:
        bench = Bench(
            base=cfg,
            layouts=layouts,
            vision_tokens=lengths,
            samples=args.samples or degree,
            steps=args.steps,
            precision=precision,
            out_dir=out,
            registry=get_registry(),
            budget=args.mem_budget,
            max_vision_tokens=max_tokens,
            progress=Progress(len(layouts) + extra),
            cluster=_time_model(args, calibration),
        )
    except ValueError as exc:  # a length the model's windows or processor cannot take; no vision model
        key = "--vision-tokens" if str(exc).startswith("--vision-tokens") else "model.vision"
        raise ConfigError([Problem(key, str(exc))]) from None
    bench.check()  # every layout's plugins and config, before the first run
    bench.sweep()
    search = (
        {name: bench.largest_under_budget(name) for name in layouts} if args.mem_budget is not None else None
    )
    files = write_outputs(bench, search, degree, predict_lengths, args.usable, calibration)
    print(files["table_text"])
    for key in ("json", "markdown", "versus_json", "versus_markdown", "throughput_png", "memory_png"):
        print(f"{key}: {files[key]}")
    return 0


def feature_cache(args: argparse.Namespace) -> int:
    """``--feature-cache KINDS``: :func:`disagg.bench.feature_cache.run_cache_bench`."""
    from pathlib import Path

    from disagg.bench.feature_cache import run_cache_bench
    from disagg.config.load import load_config
    from disagg.config.model_path import with_local_model_paths
    from disagg.plugins import get_registry

    kinds = [k.strip() for k in args.feature_cache.split(",") if k.strip()]
    if not kinds or any(k not in ("host", "disk") for k in kinds):
        raise _problem("--feature-cache", f"{args.feature_cache!r}; allowed: host, disk, host,disk")
    cfg = with_local_model_paths(load_config(args.config, args.overrides))
    out = Path(args.out) if args.out else Path(cfg.output_dir) / "bench"
    run_cache_bench(cfg, kinds, out, get_registry(), _time_model(args, _calibration(args)))
    print((out / "feature_cache.md").read_text())
    return 0


def _time_model(args: argparse.Namespace, calibration: Any) -> Any:
    """The cluster the runs' step times are predicted on: this machine measured
    (``--calibrate``), else the ``--calibration`` file (a GPU's, from ``python -m
    disagg.gpucheck``, for runs on that GPU), else the ``cpu`` preset
    (:meth:`disagg.bench.sweep.Bench.time_model`). Its name and source go in ``bench.json``."""
    if not args.calibrate:
        return calibration
    from disagg.plan.cluster import cluster_from

    return cluster_from("cpu-local")


def _cluster_precision(cfg: Any, layouts: dict[str, dict[str, Any]]) -> str:
    """``train.precision: auto`` for every layout: what the *actors* will run on (the
    Ray cluster's GPUs, as ``disagg train`` decides), not the driver's device.
    Starts the run's Ray sized for the largest layout."""
    import ray

    from disagg.runtime.plan import resolve_device_precision
    from disagg.runtime.run import ensure_ray

    def reserved(layout: dict[str, Any]) -> float:
        total = 0.0
        for m in cfg.modules():
            g = layout.get(m, {})
            cpus = (g.get("resources") or {}).get("num_cpus", getattr(cfg.parallel, m).resources.num_cpus)
            total += int(g.get("degree", 1)) * int(g.get("replicas", 1)) * float(cpus)
        return total

    ensure_ray(cfg.ray.address, cfg.ray.num_cpus, reserved=max(reserved(lay) for lay in layouts.values()))
    gpus = ray.cluster_resources().get("GPU", 0.0)
    return resolve_device_precision(cfg.train.device, "auto", gpus)[1]
