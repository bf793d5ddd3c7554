"""A small dataset shaped like real LLaVA-style data, for the end-to-end tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TEXT = [("Answer briefly.", "A red square."), ("What is in the picture?", "A blue circle.")]


def write_mixed_data(root: Path) -> Path:
    """12 samples in file order (shuffle off): step 1 mixes image sizes, a
    two-image sample and text; step 2 is text only; step 3 is mixed again."""
    import random

    from disagg.data.demo_data import draw_shape

    rng = random.Random(0)
    (root / "images").mkdir(parents=True)
    sizes = {"small": (28, 28), "wide": (56, 28), "large": (56, 56)}
    for name, (w, h) in sizes.items():
        draw_shape("red", "square", max(w, h), rng).resize((w, h)).save(root / "images" / f"{name}.png")

    def image(files: list[str], answer: str) -> dict:
        prompt = "".join("<image>" for _ in files) + "\nDescribe the image."
        paths = [f"images/{f}.png" for f in files]
        return {
            "image": paths if len(paths) > 1 else paths[0],
            "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}],
        }

    def text(k: int) -> dict:
        q, a = TEXT[k % len(TEXT)]
        return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}

    rows = [
        image(["large"], "A red square."),
        text(0),
        image(["small", "wide"], "A red square."),
        text(1),
        *(text(k) for k in range(4)),  # a text-only global batch
        image(["wide"], "A red square."),
        text(0),
        image(["large"], "A red square."),
        image(["small"], "A red square."),
    ]
    path = root / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_mixed_tiny(out: Path, family: str, eval_rows: int = 0) -> dict[str, Any]:
    """A tiny ``family`` model dir (make-tiny) with the mixed dataset beside it. ``eval_rows``:
    the last that many training rows are also the eval set (``manifest["eval"]``; 4: the last
    training batch, images of three sizes and text)."""
    from disagg.cli.make_tiny import make_tiny

    manifest = make_tiny(out, [family], data=False)
    train = write_mixed_data(out / "data")
    manifest["train"] = str(train)
    manifest["media_root"] = str(out / "data")
    if eval_rows:
        held = train.with_name("eval.jsonl")
        held.write_text("\n".join(train.read_text().splitlines()[-eval_rows:]) + "\n")
        manifest["eval"] = str(held)
    return manifest


#: the training settings of the mixed-data and video end-to-end tests: weight decay and clipping
#: on, 2 microbatches. eps=1e-3: Adam's update is then Lipschitz in the gradient, so fp32
#: summation-order noise in near-zero gradients cannot flip parameters.
TRAIN = {"lr": 1e-3, "eps": 1e-3, "weight_decay": 0.1, "microbatches": 2, "seed": 0, "clip_grad_norm": 1.0}


def mixed_config(
    model: dict, parallel: dict, data: dict, out: Path, steps: int, checkpoint_every: int = 0, **train: Any
) -> Any:
    """The config both mixed-data e2e tests run, validated: batch 4 in file order,
    2 microbatches, weight decay on; ``checkpoint_every: 1`` keeps every step's weights."""
    from disagg.config.schema import Config
    from disagg.config.validate import validate
    from disagg.plugins import get_registry

    cfg = Config.model_validate(
        {
            "model": model,
            "parallel": parallel,
            "data": {
                "train": data["train"],
                "eval": data.get("eval"),  # None: no evaluation
                "media_root": data["media_root"],
                "batch_size": 4,
                "shuffle": False,
                "num_workers": 1,
            },
            "train": {"steps": steps, **TRAIN, **train},
            "checkpoint": {"every": checkpoint_every},
            "output_dir": str(out),
        }
    )
    validate(cfg, get_registry())
    return cfg


def to_sharegpt(llava_path: Path, out: Path) -> Path:
    """The same samples as LLaMA-Factory's sharegpt/openai style writes them (``messages`` with
    ``role``/``content``, an ``images`` list), for the format-equivalence test."""
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    rows = []
    for line in llava_path.read_text().splitlines():
        row = json.loads(line)
        image = row.get("image", [])
        sg: dict[str, Any] = {
            "messages": [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]
        }
        if image:
            sg["images"] = image if isinstance(image, list) else [image]
        rows.append(sg)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
