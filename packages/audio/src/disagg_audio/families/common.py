"""Checkpoint helpers the audio families share (key names, quiet loading)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator


def checkpoint_keys(path: Path) -> list[str]:
    """Tensor names stored in an HF dir's safetensors files."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return list(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    keys: list[str] = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            keys += list(st.keys())
    return keys


def load_tensors(path: Path, prefix: str) -> dict:
    """Tensors stored under ``prefix`` in an HF dir, with the prefix stripped."""
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if k.startswith(prefix):
                    out[k[len(prefix) :]] = st.get_tensor(k)
    return out


def find_prefix(keys: list[str], probe: str, candidates: tuple[str, ...]) -> str:
    """The first prefix under which ``probe`` (a module-local key) is stored."""
    stored = set(keys)
    for prefix in candidates:
        if prefix + probe in stored:
            return prefix
    raise KeyError(f"none of the prefixes {candidates} + {probe!r} is in the checkpoint")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Loading the encoder out of a whole Whisper / Qwen2-Audio dir reports every
    decoder / LLM tensor as 'unexpected'; that is the point, so keep the log quiet."""
    from transformers.utils import logging

    old = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(old)
