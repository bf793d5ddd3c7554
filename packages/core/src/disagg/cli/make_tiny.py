"""``disagg make-tiny OUT_DIR``: tiny HF dirs for every installed family, plus the demo dataset.

Each family writes its own tiny dir (random weights, tokenizer trained on the
fly, processor configs) with ``Family.make_tiny``; a name registered for both
roles (a whole-VLM family such as ``qwen2_5_vl``) is written once, by its
encoder side, since both sides load the same whole-model dir. Nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HELP = "write tiny random-weight HF model dirs for the installed families and a demo dataset (offline)"

#: which role builds a name registered for both (the whole-model dir is the same)
ROLE_ORDER = ("encoder", "llm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write <family>/ dirs and data/")
    parser.add_argument(
        "--families",
        default=None,
        help="comma-separated family names to build (default: every installed family)",
    )
    parser.add_argument("--no-data", action="store_true", help="do not write the demo dataset")
    parser.add_argument(
        "--train-per-class", type=int, default=10, help="training images per colour+shape (default 10)"
    )
    parser.add_argument(
        "--eval-per-class", type=int, default=2, help="held-out images per colour+shape (default 2)"
    )
    parser.add_argument("--image-size", type=int, default=48, help="side of the square demo images in pixels")
    parser.add_argument(
        "--large",
        type=int,
        default=0,
        metavar="N",
        help="also write data/large.jsonl: N samples reusing the demo images (for scale tests)",
    )


def make_tiny(
    out_dir: str | Path,
    families: list[str] | None = None,
    *,
    data: bool = True,
    train_per_class: int = 10,
    eval_per_class: int = 2,
    image_size: int = 48,
    large: int = 0,
    registry: Any = None,
) -> dict[str, Any]:
    """Build the dirs; return the manifest also written to ``OUT_DIR/manifest.json``:
    ``{"models": {name: dir}, "skipped": {name: why}, "data": {split: file}, "media_root": dir}``."""
    from disagg.plugins import get_registry

    reg = registry or get_registry()
    out = Path(out_dir)
    by_name: dict[str, dict[str, type]] = {}
    for (role, name), cls in reg.families.items():
        by_name.setdefault(name, {})[role] = cls
    if families is not None:
        unknown = sorted(set(families) - set(by_name))
        if unknown:
            raise ValueError(
                f"--families: unknown family {', '.join(map(repr, unknown))}; "
                f"installed: {', '.join(sorted(by_name)) or 'none'}"
            )
    names = sorted(by_name) if families is None else list(dict.fromkeys(families))
    manifest: dict[str, Any] = {"models": {}, "skipped": {}, "data": {}}
    for name in names:
        roles = by_name[name]
        cls = next(roles[r] for r in ROLE_ORDER if r in roles)
        try:
            path = cls.make_tiny(out / name)
        except NotImplementedError as exc:
            manifest["skipped"][name] = str(exc)
            continue
        manifest["models"][name] = str(path)
        for variant, build in cls.tiny_variants().items():
            manifest["models"][variant] = str(build(out / variant))

    if data:
        from disagg.data.demo_data import make_demo_data

        audio = any(getattr(cls, "modality", None) == "audio" for cls in reg.families.values())
        files = make_demo_data(
            out / "data",
            train_per_class=train_per_class,
            eval_per_class=eval_per_class,
            image_size=image_size,
            audio=audio,
        )
        if large:
            from disagg.data.synthetic import write_large

            files["large"] = write_large(files["train"], out / "data" / "large.jsonl", large)
        manifest["data"] = {k: str(v) for k, v in files.items()}
        manifest["media_root"] = str(out / "data")
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.families.split(",") if n.strip()] if args.families else None
    manifest = make_tiny(
        args.out_dir,
        names,
        data=not args.no_data,
        train_per_class=args.train_per_class,
        eval_per_class=args.eval_per_class,
        image_size=args.image_size,
        large=args.large,
    )
    for name, path in manifest["models"].items():
        print(f"{name}: {path}")
    for name, why in manifest["skipped"].items():
        print(f"{name}: skipped ({why})")
    for split, path in manifest["data"].items():
        print(f"data {split}: {path}")
    if not manifest["models"]:
        print("no family with a tiny-model builder is installed (see `disagg plugins`)")
    return 0
