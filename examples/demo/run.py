"""The demo: a tiny VLM learns to caption coloured shapes, on local Ray, on CPU.

    python examples/demo/run.py [--out runs/demo] [--steps 200] [--omni] [--lora]

1. ``disagg make-tiny``: a tiny random-weight Qwen2.5-VL dir and the shapes dataset.
2. A config: vision ``ulysses`` degree 2 (sequence parallel), LLM
   ``megatron_tp`` degree 2 (tensor parallel), collocated; written to
   ``<out>/demo.yaml`` so ``disagg train <out>/demo.yaml`` repeats the run.
3. Held-out captions from the untrained model, training with a progress bar,
   the checkpoint exported to an HF dir, held-out captions again.

``--lora``: PEFT LoRA adapters per module instead of full weights (the vision
tower's fused ``qkv`` and projection with the merger trained in full, every
LLM linear; ``train.modules.<m>.lora``), exported with ``--merge``.

``--omni``: three modules from three dirs (Qwen2.5-VL vision ``ulysses`` 2,
Whisper audio ``ddp``, Qwen2 LLM ``megatron_tp`` 2) on samples that mix
images, tones, both and neither (see ``omni.py``); the export is one HF dir
per module plus ``disagg_model.json``, from which the held-out answers are
generated.

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

import omni  # noqa: E402 - next to this file

FAMILY = "qwen2_5_vl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo", help="where tiny models, data and the run dir go")
    p.add_argument(
        "--steps", type=int, default=200, help="optimizer steps (default 200, a few minutes on 2 cores)"
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--lr", type=float, default=None, help="peak learning rate (default 3e-3; 1e-2 with --lora)"
    )
    p.add_argument(
        "--vision-lr", type=float, default=None, help="learning rate of the vision tower (default --lr)"
    )
    p.add_argument("--train-per-class", type=int, default=10, help="training images per colour+shape")
    p.add_argument("--image-size", type=int, default=48, help="side of the square demo images in pixels")
    p.add_argument("--eval-samples", type=int, default=48, help="held-out samples to caption")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--lora",
        action="store_true",
        help="train PEFT LoRA adapters instead of the weights: on the tower's fused qkv and its "
        "projection (the merger in full) and on every LLM linear; exported merged (--merge)",
    )
    omni.add_arguments(p)
    return p.parse_args(argv)


def demo_config(
    manifest: dict, out: Path, args: argparse.Namespace, model: dict, parallel: dict, split: str = ""
) -> dict:
    return {
        "model": model,
        "parallel": parallel,
        "data": {
            "train": manifest["data"][f"{split}train"],
            "eval": manifest["data"][f"{split}eval"],
            "media_root": manifest["media_root"],
            "batch_size": args.batch_size,
            "num_workers": 2,
        },
        "train": {
            "steps": args.steps,
            "lr": args.lr or (1e-2 if args.lora else 3e-3),
            "seed": 0,
            "clip_grad_norm": 1.0,
            "scheduler": "cosine",
            "warmup_steps": max(1, args.steps // 20),
            "modules": lora_modules(args, model) if args.lora else vision_lr(args),
        },
        "checkpoint": {"every": 0},
        "output_dir": str(out / "run"),
    }


def vision_lr(args: argparse.Namespace) -> dict:
    return {"vision": {"lr": args.vision_lr}} if args.vision_lr else {}


#: ``--lora``: every LLM linear but the output head, the tower's attention (its fused qkv)
LLM_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_modules(args: argparse.Namespace, model: dict) -> dict:
    """``train.modules`` of ``--lora``: adapters per module, each its own choice (the merger
    and the LLM's output head train in full; under ``--omni`` the audio encoder trains in full)."""
    modules = vision_lr(args)
    modules.setdefault("vision", {})["lora"] = {
        "r": 8,
        "alpha": 16,
        "targets": ["attn.qkv", "attn.proj"],
        "modules_to_save": ["merger"],
    }
    # the tiny model's output head is random too: it trains in full (PEFT modules_to_save)
    modules["llm"] = {"lora": {"r": 16, "alpha": 32, "targets": LLM_TARGETS, "modules_to_save": ["lm_head"]}}
    return modules


VLM_PARALLEL = {
    "placement": "collocated",
    "vision": {"strategy": "ulysses", "degree": 2, "replicas": 1},
    "llm": {"strategy": "megatron_tp", "degree": 2, "replicas": 1},
}


def main(argv: list[str] | None = None) -> int:
    import yaml
    from evaluate import evaluate, load_eval

    from disagg.cli.make_tiny import make_tiny
    from disagg.config.load import load_config
    from disagg.config.validate import validate
    from disagg.plugins import get_registry
    from disagg.runtime.export import export_checkpoint, load_exported
    from disagg.runtime.plan import families_for
    from disagg.runtime.run import run_training

    args = parse_args(argv)
    out = Path(args.out).resolve()
    tiny = out / "tiny"
    t0 = time.time()
    registry = get_registry()
    names = [omni.VISION, omni.AUDIO] if args.omni else [FAMILY]
    print(f"[1/4] tiny {' + '.join(names)} models and the demo dataset -> {tiny}", flush=True)
    manifest = make_tiny(
        tiny, names, train_per_class=args.train_per_class, eval_per_class=2, image_size=args.image_size
    )
    if args.omni:
        _, width = omni.build_llm(tiny, registry)
        model, parallel, split = omni.omni_model(tiny, width), omni.OMNI_PARALLEL, "omni_"
        layout = "vision ulysses x2 + audio ddp + LLM megatron_tp x2"
    else:
        vlm = {"family": FAMILY, "path": str(tiny / FAMILY)}
        model, parallel, split = {"vision": vlm, "llm": vlm}, VLM_PARALLEL, ""
        layout = "vision ulysses x2 + LLM megatron_tp x2"
    config_path = out / "demo.yaml"
    config = demo_config(manifest, out, args, model, parallel, split)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    cfg = load_config(config_path)
    validate(cfg, registry)
    eval_file = manifest["data"][f"{split}eval"]
    if args.omni:
        held_out = omni.load_omni_eval(eval_file, manifest["media_root"], args.eval_samples)
    else:
        held_out = load_eval(eval_file, manifest["media_root"], args.eval_samples)

    print(f"[2/4] held-out answers before training ({len(held_out)} samples)", flush=True)
    if args.omni:
        before = omni.evaluate_omni(families_for(cfg, registry), held_out)
    else:
        before = evaluate(tiny / FAMILY, FAMILY, held_out)

    print(f"[3/4] training: {layout}, collocated, local Ray on CPU", flush=True)
    summary = run_training(validate(cfg, get_registry()), progress=not args.no_progress)

    print("[4/4] exporting the checkpoint and answering the held-out samples again", flush=True)
    export_dir = Path(summary["run_dir"]) / "export"
    # --lora: merged weights, so that plain from_pretrained (and the manifest) load the trained model
    exported = export_checkpoint(summary["checkpoint"], export_dir, registry, merge=args.lora)
    if args.omni:
        after = omni.evaluate_omni(load_exported(export_dir, registry), held_out)
    else:
        after = evaluate(exported[0], FAMILY, held_out)

    result = {
        "before": before,
        "after": after,
        "summary": summary,
        "export": str(export_dir),
        "minutes": (time.time() - t0) / 60,
    }
    (Path(summary["run_dir"]) / "demo_result.json").write_text(json.dumps(result, indent=2))
    print()
    print(
        f"loss: {summary['first_loss']:.3f} (step 1) -> {summary['last_loss']:.3f} (step {summary['steps']})"
    )
    for name, r in (("before", before), ("after", after)):
        if args.omni:
            print(omni.report(r, name))
        else:
            print(
                f"held-out {name:6s}: exact match {r['exact_match']:.0%}, colour {r['colour_acc']:.0%}, "
                f"shape {r['shape_acc']:.0%}  (n={r['n']})"
            )
    for ex in after["examples"]:
        media = ex.get("media", ex.get("image"))
        print(f"  {media}: {ex['generated']!r}  (reference {ex.get('answer', ex.get('caption'))!r})")
    print(f"run dir: {summary['run_dir']}")
    print(f"checkpoint: {summary['checkpoint']}  exported: {', '.join(map(str, exported))}")
    print(f"repeat with: disagg train {config_path}")
    score = omni.score if args.omni else lambda r: r["exact_match"] + r["colour_acc"] + r["shape_acc"]
    ok = summary["last_loss"] < 0.5 * summary["first_loss"] and score(after) > score(before)
    if not ok:
        print("training did not clearly improve the model", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
