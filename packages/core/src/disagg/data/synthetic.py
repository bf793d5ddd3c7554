"""A large synthetic dataset for scale tests: many samples, few distinct media files.

The rows of a small dataset are repeated (each copy's answer numbered, so no two
samples are byte-identical) and written line by line: writing 1M samples needs
no more memory than writing 10, and the media on disk stay those of the small set.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_large(source: str | Path, out: str | Path, samples: int) -> Path:
    """``out``: ``samples`` JSONL lines cycling through the samples of JSONL ``source``
    (media paths unchanged, so ``data.media_root`` stays the source's)."""
    rows = [json.loads(line) for line in Path(source).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{source}: no samples to repeat")
    out = Path(out)
    with out.open("w") as f:
        for i in range(samples):
            row = rows[i % len(rows)]
            turns = row.get("conversations", row.get("messages"))
            copy = dict(row)
            key = "conversations" if "conversations" in row else "messages"
            # the copy number goes into the last (assistant) turn: distinct samples, same media
            last = dict(turns[-1])
            text_key = "value" if "value" in last else "content"
            last[text_key] = f"{last[text_key]} ({i // len(rows)})"
            copy[key] = [*turns[:-1], last]
            f.write(json.dumps(copy) + "\n")
    return out
