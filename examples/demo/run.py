"""The demo: a tiny VLM learns to caption coloured shapes, on local Ray, on CPU.

    python examples/demo/run.py [--out runs/demo] [--steps 200]

1. ``disagg make-tiny``: a tiny random-weight Qwen2.5-VL dir and the shapes dataset.
2. A config: vision ``ulysses`` degree 2 (sequence parallel), LLM
   ``megatron_tp`` degree 2 (tensor parallel), collocated; written to
   ``<out>/demo.yaml`` so ``disagg train <out>/demo.yaml`` repeats the run.
3. Held-out captions from the untrained model, training with a progress bar,
   the checkpoint exported to an HF dir, held-out captions again.

Exits 1 if training did not clearly help (loss and held-out score), so the
demo doubles as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# A demo should show its own progress, not every worker's weight-loading bar and
# library advisories; set these yourself to see them (Ray workers inherit them).
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("PYTHONWARNINGS", "ignore")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

FAMILY = "qwen2_5_vl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo", help="where tiny models, data and the run dir go")
    p.add_argument(
        "--steps", type=int, default=200, help="optimizer steps (default 200, a few minutes on 2 cores)"
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--vision-lr", type=float, default=None, help="learning rate of the vision tower (default --lr)"
    )
    p.add_argument("--train-per-class", type=int, default=10, help="training images per colour+shape")
    p.add_argument("--image-size", type=int, default=48, help="side of the square demo images in pixels")
    p.add_argument("--eval-samples", type=int, default=48, help="held-out samples to caption")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def demo_config(tiny: Path, manifest: dict, out: Path, args: argparse.Namespace) -> dict:
    vlm = str(tiny / FAMILY)
    return {
        "model": {"vision": {"family": FAMILY, "path": vlm}, "llm": {"family": FAMILY, "path": vlm}},
        "parallel": {
            "placement": "collocated",
            "vision": {"strategy": "ulysses", "degree": 2, "replicas": 1},
            "llm": {"strategy": "megatron_tp", "degree": 2, "replicas": 1},
        },
        "data": {
            "train": manifest["data"]["train"],
            "eval": manifest["data"]["eval"],
            "media_root": manifest["media_root"],
            "batch_size": args.batch_size,
            "num_workers": 2,
        },
        "train": {
            "steps": args.steps,
            "lr": args.lr,
            "seed": 0,
            "clip_grad_norm": 1.0,
            "scheduler": "cosine",
            "warmup_steps": max(1, args.steps // 20),
            "modules": {"vision": {"lr": args.vision_lr}} if args.vision_lr else {},
        },
        "checkpoint": {"every": 0},
        "output_dir": str(out / "run"),
    }


def main(argv: list[str] | None = None) -> int:
    import yaml
    from evaluate import evaluate, load_eval

    from disagg.cli.make_tiny import make_tiny
    from disagg.config.load import load_config
    from disagg.config.validate import validate
    from disagg.plugins import get_registry
    from disagg.runtime.checkpoint import export_checkpoint
    from disagg.runtime.run import run_training

    args = parse_args(argv)
    out = Path(args.out).resolve()
    t0 = time.time()
    print(f"[1/4] tiny {FAMILY} model and shapes dataset -> {out / 'tiny'}", flush=True)
    manifest = make_tiny(
        out / "tiny",
        [FAMILY],
        train_per_class=args.train_per_class,
        eval_per_class=2,
        image_size=args.image_size,
    )
    config_path = out / "demo.yaml"
    config_path.write_text(yaml.safe_dump(demo_config(out / "tiny", manifest, out, args), sort_keys=False))
    cfg = load_config(config_path)
    registry = get_registry()
    validate(cfg, registry)
    held_out = load_eval(manifest["data"]["eval"], manifest["media_root"], args.eval_samples)

    print(f"[2/4] held-out captions before training ({len(held_out)} samples)", flush=True)
    before = evaluate(out / "tiny" / FAMILY, FAMILY, held_out)

    print("[3/4] training: vision ulysses x2 + LLM megatron_tp x2, collocated, local Ray on CPU", flush=True)
    summary = run_training(cfg, progress=not args.no_progress)

    print("[4/4] exporting the checkpoint and captioning the held-out samples again", flush=True)
    exported = export_checkpoint(summary["checkpoint"], Path(summary["run_dir"]) / "export", registry)[0]
    after = evaluate(exported, FAMILY, held_out)

    result = {
        "before": before,
        "after": after,
        "summary": summary,
        "export": str(exported),
        "minutes": (time.time() - t0) / 60,
    }
    (Path(summary["run_dir"]) / "demo_result.json").write_text(json.dumps(result, indent=2))
    print()
    print(
        f"loss: {summary['first_loss']:.3f} (step 1) -> {summary['last_loss']:.3f} (step {summary['steps']})"
    )
    for name, r in (("before", before), ("after", after)):
        print(
            f"held-out {name:6s}: exact match {r['exact_match']:.0%}, colour {r['colour_acc']:.0%}, "
            f"shape {r['shape_acc']:.0%}  (n={r['n']})"
        )
    for ex in after["examples"]:
        print(f"  {ex['image']}: {ex['generated']!r}  (reference {ex['caption']!r})")
    print(f"run dir: {summary['run_dir']}")
    print(f"checkpoint: {summary['checkpoint']}  exported HF dir: {exported}")
    print(f"repeat with: disagg train {config_path}")
    score = lambda r: r["exact_match"] + r["colour_acc"] + r["shape_acc"]  # noqa: E731
    ok = summary["last_loss"] < 0.5 * summary["first_loss"] and score(after) > score(before)
    if not ok:
        print("training did not clearly improve the model", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
