"""The key of a cached encoder output: everything that decides the exact tensors the LLM
receives for a sample. A change of any part misses every entry; none is ever reused stale.

- the sample's media as preprocessed (``SampleRefs.media_digest``, :mod:`disagg.data.digest`);
- the preprocessing settings: ``data.min_pixels`` / ``data.max_pixels`` and the bytes of the
  model dir's processor config files;
- the module's weights: a digest of every rank's loaded state (:func:`state_digest`, computed
  once per run on the group, after a resume has loaded its checkpoint). Hashing the state is
  exact and cheap at tiny scale; at the 675M-parameter tower of Qwen2.5-VL it reads ~1.3 GB
  once per run (seconds), which a run of many steps repays;
- the family's name, the module's name, and the run's precision recipe (the output dtype).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: files of an HF model dir that configure its processor (their bytes enter the key)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def state_digest(module: torch.nn.Module) -> str:
    """sha256 over a module's state (names, dtypes, shapes, bytes) as this rank holds it."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def processor_digest(model_dir: str | Path) -> str:
    """sha256 over the processor config files of ``model_dir`` (those present)."""
    h = hashlib.sha256()
    for name in PROCESSOR_FILES:
        p = Path(model_dir) / name
        if p.is_file():
            h.update(name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@dataclass(frozen=True)
class RunKey:
    """The run's part of every key of one module's cache."""

    module: str
    family: str
    precision: str
    preprocessing: dict[str, Any]
    #: digests of the group's ranks' states, in rank order
    weights: tuple[str, ...]

    def key(self, media_digest: str) -> str:
        """The key of one sample's entry (a hex sha256)."""
        run = json.dumps(
            {
                "module": self.module,
                "family": self.family,
                "precision": self.precision,
                "preprocessing": self.preprocessing,
                "weights": list(self.weights),
            },
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(f"{run}\n{media_digest}".encode()).hexdigest()
