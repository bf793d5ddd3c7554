"""Synthetic data for a vision-length sweep: images of exactly N patches.

Every layout of a bench reads the same files (same seed), so only the layout
differs. Images are random noise (throughput and memory do not depend on the
pixels) whose sides are whole attention windows, so Qwen2.5-VL's processor keeps
them as they are and ``ulysses`` can cut shards on window boundaries.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path
from typing import Any

#: processor settings that would resize a long image below the swept length
_SIZE_KEYS = ("size", "min_pixels", "max_pixels")


def parse_tokens(text: str) -> list[int]:
    """``"1k,4k,16384"`` -> ``[1024, 4096, 16384]`` (k = 1024)."""
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        if not p:
            continue
        try:
            out.append(int(float(p[:-1]) * 1024) if p.endswith("k") else int(p))
        except ValueError:
            raise ValueError(f"--vision-tokens: {part!r} is not a number (e.g. 1k,4k,16384)") from None
    if not out or any(n <= 0 for n in out):
        raise ValueError(f"--vision-tokens {text!r}: give positive lengths, e.g. 1k,4k,16k")
    return sorted(set(out))


#: Qwen2-VL's image processor refuses an image whose long side is this many times its short one
MAX_ASPECT = 200
#: the budget search probes only lengths whose grid is at most this elongated (photo-like)
SEARCH_ASPECT = 4


def _factor(units: int) -> tuple[int, int]:
    """``(a, b)``, ``a * b == units``, ``a <= b``, as square as possible."""
    best = 1
    for a in range(1, math.isqrt(units) + 1):
        if units % a == 0:
            best = a
    return best, units // best


def grid_for(n: int, window_side: int, merge: int) -> tuple[int, int]:
    """Patch grid ``(rows, cols)`` with ``rows * cols == n`` and both sides whole
    windows (``window_side`` patches), as square as possible."""
    side = max(window_side, merge)
    if n % (side * side):
        raise ValueError(
            f"--vision-tokens: {n} is not a whole number of {side}x{side}-patch attention windows; "
            f"use a multiple of {side * side}"
        )
    a, b = _factor(n // (side * side))
    if b / a >= MAX_ASPECT:
        near = [snap_length(n, window_side, merge, below) for below in (True, False)]
        raise ValueError(
            f"--vision-tokens: {n} patches make only a {a * side}x{b * side} grid of whole windows "
            f"(aspect {b / a:.0f}, the image processor refuses {MAX_ASPECT} or more); "
            f"use e.g. {near[0]} or {near[1]}"
        )
    return a * side, b * side


def snap_length(n: int, window_side: int, merge: int, below: bool = True) -> int:
    """The length nearest ``n`` (at or under it with ``below``, else over) whose
    grid of whole windows is at most :data:`SEARCH_ASPECT` times as long as wide."""
    side = max(window_side, merge)
    k = max(1, n // (side * side) if below else -(-n // (side * side)))
    step = -1 if below else 1
    while k > 1:
        a, b = _factor(k)
        if b / a <= SEARCH_ASPECT:
            break
        k += step
    return k * side * side


def private_model_dir(src: Path, dst: Path, max_patches: int, patch: int) -> Path:
    """A copy of ``src`` (weights linked, not copied) whose image processor
    accepts ``max_patches`` patches unresized."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        target = dst / f.name
        if target.exists() or target.is_symlink():
            target.unlink()
        if f.name == "preprocessor_config.json":
            continue
        target.symlink_to(f.resolve())
    proc = json.loads((src / "preprocessor_config.json").read_text())
    longest = max_patches * patch * patch
    if "size" in proc:
        proc["size"] = {"shortest_edge": patch * patch, "longest_edge": longest}
    proc["max_pixels"], proc["min_pixels"] = longest, patch * patch
    (dst / "preprocessor_config.json").write_text(json.dumps(proc, indent=2))
    return dst


def write_sweep_data(
    out: Path, n_patches: int, samples: int, patch: int, window_side: int, merge: int, seed: int
) -> Path:
    """``samples`` one-image samples of ``n_patches`` patches under ``out``;
    returns the JSONL path (media paths relative to ``out``)."""
    import numpy as np
    from PIL import Image

    if out.exists():
        shutil.rmtree(out)
    (out / "images").mkdir(parents=True)
    rows, cols = grid_for(n_patches, window_side, merge)
    rng = np.random.default_rng(seed)
    words = random.Random(seed)
    lines: list[dict[str, Any]] = []
    for k in range(samples):
        pixels = rng.integers(0, 256, size=(rows * patch, cols * patch, 3), dtype=np.uint8)
        name = f"images/{k:04d}.png"
        Image.fromarray(pixels).save(out / name)
        answer = f"A {words.choice(['red', 'green', 'blue'])} {words.choice(['square', 'circle'])}."
        lines.append(
            {
                "image": name,
                "conversations": [
                    {"from": "human", "value": "<image>\nDescribe the image."},
                    {"from": "gpt", "value": answer},
                ],
            }
        )
    path = out / "train.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path
