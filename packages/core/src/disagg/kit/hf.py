"""Family kit: what every Hugging Face family needs to read its dir, in one place.

Families load one module out of an HF dir that may hold a whole model (one
tower of a VLM, the encoder of Whisper), so they need the dir's tensor names,
the prefix their module is stored under, quiet loading and the same check of
``attn_implementation``. Plugins import these from here instead of keeping copies.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: values of ``model.<m>.options.attn_implementation`` the first-party families accept
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")


def checkpoint_keys(path: Path) -> list[str]:
    """Tensor names stored in an HF dir's safetensors files (index or headers only, no tensor read)."""
    index = Path(path) / "model.safetensors.index.json"
    if index.exists():
        return list(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    keys: list[str] = []
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            keys += list(st.keys())
    return keys


def load_tensors(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Tensors stored under ``prefix`` in an HF dir, with the prefix stripped."""
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if k.startswith(prefix):
                    out[k[len(prefix) :]] = st.get_tensor(k)
    return out


def empty_from_config(cls: type, config: Any, **kwargs: Any) -> nn.Module:
    """``cls`` (a transformers ``PreTrainedModel``) built from ``config`` with every
    parameter and persistent buffer on the meta device: nothing allocated, nothing
    read; whoever holds it materializes and loads its own part. Non-persistent
    buffers (rotary frequencies) are not in checkpoints, so they are computed on the
    CPU by the model's own ``initialize_weights``, as ``from_pretrained`` does for
    every key it did not load. Left in eval mode, as ``from_pretrained`` leaves it."""
    with torch.device("meta"):
        # a copy: ``_from_config`` writes ``attn_implementation`` into the config it is given, and
        # families hand in the one they keep (:meth:`disagg.interfaces.family.Family.hf_config`)
        model = cls._from_config(copy.deepcopy(config), **kwargs)
    for t in (*model.parameters(), *model.buffers()):
        t._is_hf_initialized = True  # transformers' init functions skip flagged tensors
    for p in model.parameters():
        # from_pretrained makes every loaded float parameter trainable, whatever __init__ set
        # (Whisper's frozen embed_positions trains once loaded): the loaded module's flags
        p.requires_grad_(p.is_floating_point())
    for name, buf in list(model.named_non_persistent_buffers()):
        owner, _, leaf = name.rpartition(".")
        value = torch.empty_like(buf, device="cpu")
        model.get_submodule(owner)._buffers[leaf] = value
    model.initialize_weights()
    return model.eval()


def find_prefix(keys: list[str], probe: str, candidates: tuple[str, ...]) -> str:
    """The first prefix under which ``probe`` (a module-local key) is stored."""
    stored = set(keys)
    for prefix in candidates:
        if prefix + probe in stored:
            return prefix
    raise KeyError(f"none of the prefixes {candidates} + {probe!r} is in the checkpoint")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Loading one module out of a whole-model dir (a VLM's tower, Whisper's encoder)
    reports every other tensor as 'unexpected'; that is the point, so keep the log quiet."""
    from transformers.utils import logging

    old = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(old)


def check_attn_implementation(options: dict[str, Any], module: str) -> list[str]:
    """Problems with ``model.<module>.options.attn_implementation`` (``sdpa`` when unset)."""
    impl = options.get("attn_implementation", "sdpa")
    if impl not in ATTN_IMPLEMENTATIONS:
        return [
            f"model.{module}.options.attn_implementation={impl!r} is not supported; "
            f"allowed: {', '.join(ATTN_IMPLEMENTATIONS)}"
        ]
    return []


def allowed_head_degrees(heads: int, kv_heads: int) -> list[int]:
    """Degrees that split ``heads`` query heads evenly and split or replicate
    ``kv_heads`` key/value heads evenly."""
    return [d for d in range(1, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]


def head_split_problems(heads: int, kv_heads: int | None, degree: int, where: str) -> list[str]:
    """Sentences for a degree that cannot split an attention's heads (``where``: the dir);
    ``kv_heads`` None: no grouped key/value heads to check."""
    if degree == 1:
        return []
    ok = ", ".join(map(str, allowed_head_degrees(heads, heads if kv_heads is None else kv_heads)))
    problems = []
    if heads % degree:
        problems.append(
            f"{heads} attention heads of {where} are not divisible by degree {degree}; allowed degrees: {ok}"
        )
    if kv_heads is not None and kv_heads % degree and degree % kv_heads:
        problems.append(
            f"{kv_heads} key/value heads of {where} can be neither split nor replicated evenly over "
            f"degree {degree}; allowed degrees: {ok}"
        )
    return problems


def transformers_problems(family_cls: type, name: str) -> list[str]:
    """What keeps family ``name`` from running on the installed transformers: its
    ``requires_transformers`` floor above the installed release (one sentence naming both and the
    upgrade), else nothing."""
    need = getattr(family_cls, "requires_transformers", None)
    if need is None:
        return []
    from importlib.metadata import version

    from packaging.version import Version

    floor, why = need
    have = version("transformers")
    if Version(have) >= Version(floor):
        return []
    return [
        f"family {name!r} needs transformers>={floor} ({why}); this environment has {have}: "
        f"pip install -U 'transformers>={floor}'"
    ]
