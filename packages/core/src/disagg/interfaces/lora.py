"""``train.modules.<m>.lora`` resolved for one module: what config validation, cost hooks and
strategies share (the adapters themselves are built by :mod:`disagg.kit.lora`)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

#: the adapter name PEFT layers are created under (PEFT's default; exported dirs load as it)
ADAPTER = "default"
INSTALL_HINT = "pip install 'disagg-core[lora]'"


@dataclass(frozen=True)
class LoraSpec:
    """``train.modules.<m>.lora`` resolved for one module."""

    r: int
    alpha: float
    dropout: float
    #: PEFT ``target_modules``: full module names or suffixes of whole components
    targets: tuple[str, ...]
    #: module names trained in full beside the adapters (PEFT ``modules_to_save``),
    #: resolved from the family's part names
    modules_to_save: tuple[str, ...] = ()
    #: the parts' parameter-name patterns (what stays trainable of the base)
    save_patterns: tuple[str, ...] = ()
    #: ``train.seed``: with the module name it seeds the adapters' initial values
    seed: int = 0


def lora_seed(seed: int, module: str) -> int:
    """The seed the adapters of ``module`` are initialized under (same on every rank)."""
    return (seed * 1_000_003 + zlib.crc32(module.encode())) % (2**63 - 1)
