"""``disagg train``: load and validate the config, then hand it to the runtime."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "train from a YAML config (validated before any actor starts)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the run's YAML config")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.lr=1e-4 (repeatable; values are YAML)",
    )
    parser.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        metavar="auto|PATH",
        help="resume from a checkpoints/step-N dir, or (auto, the default value) from the newest "
        "complete checkpoint of the run dir (none yet: start from step 0)",
    )
    parser.add_argument(
        "--address", default=None, help="Ray address to join (e.g. 'auto'); default: ray.address or local Ray"
    )


def run(args: argparse.Namespace) -> int:
    from disagg.config.load import load_config_and_source
    from disagg.config.validate import load_checked, validate
    from disagg.plugins import get_registry

    cfg, source = load_checked(args.config, args.overrides, get_registry())  # schema + checks: one pass
    if args.resume:
        path = _resume_path(args.resume, cfg.output_dir)
        if path is not None:
            cfg, source = load_config_and_source(
                args.config, [*args.overrides, f"checkpoint.resume_from={json.dumps(path)}"]
            )
    record = None
    if cfg.parallel.auto is not None:  # plan first (it reads the model dirs); train the best layout
        from disagg.config.model_path import with_local_model_paths

        cfg = with_local_model_paths(cfg, source)
        from disagg.plan.auto import record_plan, resolve_auto

        cfg, record = resolve_auto(cfg, get_registry())
        print(f"parallel: auto chose {record['chosen']}", file=sys.stderr)
    resolved = validate(cfg, get_registry(), source=source)
    if record is not None:
        record_plan(cfg.output_dir, record)
    # Only now, with a config known to be sound, do we touch Ray.
    from disagg.runtime.run import run_training

    address = args.address if args.address is not None else cfg.ray.address
    summary = run_training(resolved, address=address)
    print(format_summary(summary))
    return 0


def _resume_path(resume: str, output_dir: str) -> str | None:
    if resume != "auto":
        return resume
    from disagg.runtime.checkpoint import latest_checkpoint

    path = latest_checkpoint(output_dir)
    if path is None:
        print(
            f"--resume auto: no complete checkpoint under {output_dir}/checkpoints; starting at step 0",
            file=sys.stderr,
        )
        return None
    print(f"--resume auto: resuming from {path}", file=sys.stderr)
    return str(path)


def _steps_run(summary: dict) -> str:
    """The steps this invocation ran: after ``--resume``, not the checkpoint's steps too."""
    run, last = summary.get("steps_run", summary["steps"]), summary["steps"]
    first = summary.get("first_step", 1)
    return f"{run} steps" if first == 1 else f"{run} steps ({first}-{last}, resumed at step {first - 1})"


def format_summary(summary: dict) -> str:
    """The final summary a person reads after the progress bar."""
    if not summary.get("steps"):
        return f"no steps run; run dir: {summary.get('run_dir')}"
    lines = [
        f"trained {_steps_run(summary)}: loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}",
        f"mean throughput: {summary['mean_tokens_per_s']:.1f} tokens/s",
        *(
            [
                f"eval loss: {summary['eval_loss']:.4f} (best {summary['best_eval_loss']:.4f} "
                f"after step {summary['best_eval_step']})"
            ]
            if "eval_loss" in summary
            else []
        ),
        f"skipped samples: {summary['skipped_samples']}, dropped (too long): {summary['dropped_too_long']}"
        + (f", truncated: {summary['truncated_too_long']}" if summary.get("truncated_too_long") else ""),
        f"run dir: {summary['run_dir']}",
    ]
    if summary.get("best_checkpoint"):
        lines.append(f"best checkpoint (checkpoint.keep_best): {summary['best_checkpoint']}")
    if summary.get("checkpoint"):
        lines.append(
            f"checkpoint: {summary['checkpoint']}  (export: disagg export {summary['checkpoint']} OUT_DIR)"
        )
    return "\n".join(lines)
