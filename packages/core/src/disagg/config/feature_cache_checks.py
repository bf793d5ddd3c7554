"""``parallel.<m>.feature_cache``: what a cache of a frozen encoder's outputs needs before any
actor starts: a module that does not train (a cached output of a training module would be
stale after one step), a dir it can write, and room for at least one global batch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from disagg.config.problems import Problems
from disagg.config.schema import Config
from disagg.plugins import Registry

#: bytes per element of a cached output when the precision is not known yet (``auto``):
#: the smaller one, so that a size is refused only when it is surely too small
_UNKNOWN_ELEMENT_BYTES = 2


def cache_dir(cfg: Config, module: str) -> Path:
    """Where ``parallel.<module>.feature_cache: disk`` keeps its entries."""
    g = getattr(cfg.parallel, module)
    if g.feature_cache_dir:
        return Path(g.feature_cache_dir)
    return Path(cfg.output_dir) / "feature_cache" / module


def check_feature_cache(cfg: Config, registry: Registry, out: Problems) -> None:
    for m in cfg.modules():
        g = getattr(cfg.parallel, m)
        _settings_without_cache(g, m, out)
        if g.feature_cache == "none":
            continue
        key = ("parallel", m, "feature_cache")
        if m == "llm":
            out.add(key, f"{g.feature_cache!r}: only an encoder's outputs can be cached; allowed: none")
            continue
        mt = cfg.train.modules.get(m)
        if mt is None or mt.freeze is not True or mt.lora is not None:
            trains = "trains LoRA adapters" if mt is not None and mt.lora is not None else "trains"
            out.add(
                key,
                f"{g.feature_cache!r} caches outputs that training would make stale, and module {m!r} "
                f"{trains}; set train.modules.{m}.freeze: true (the whole module, no lora) or "
                "feature_cache: none (allowed: none, host, disk)",
            )
        if g.feature_cache == "disk":
            _writable(cfg, m, out)
        _room_for_a_batch(cfg, registry, m, out)


def _settings_without_cache(g: Any, m: str, out: Problems) -> None:
    """A cache setting that the chosen kind ignores is a mistake, not a no-op."""
    if g.feature_cache_dir is not None and g.feature_cache != "disk":
        out.add(
            ("parallel", m, "feature_cache_dir"),
            f"is set but parallel.{m}.feature_cache is {g.feature_cache!r}; only disk uses a dir "
            "(allowed: feature_cache: disk, or remove feature_cache_dir)",
        )
    if g.feature_cache_ahead and g.feature_cache == "none":
        out.add(
            ("parallel", m, "feature_cache_ahead"),
            f"{g.feature_cache_ahead} batches ahead need a feature cache to put them in; set "
            f"parallel.{m}.feature_cache: host or disk, or feature_cache_ahead: 0",
        )


def _writable(cfg: Config, m: str, out: Problems) -> None:
    path = cache_dir(cfg, m)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the nearest existing dir is where the cache dir will be made
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        key = ("parallel", m, "feature_cache_dir")
        out.add(
            key,
            f"{str(path)!r} cannot be written ({str(probe)!r} is not a writable dir); "
            "give a writable dir every node sees, or leave it unset for <output_dir>/feature_cache",
        )


def one_batch_bytes(cfg: Config, registry: Registry, m: str) -> int | None:
    """Bytes of one global batch's outputs of encoder ``m`` at the planning shape: batch size x
    tokens per sample (one image at ``data.max_pixels``, else the planner's default) x output
    width x element size; None when the family describes no planning shape."""
    from disagg.interfaces.shapes import EncoderShape
    from disagg.plan.workload import DEFAULT_VISION_PATCHES, config_shapes, patches_per_image

    try:
        shapes = config_shapes(cfg, registry)
    except Exception:  # an unreadable dir is model_checks' problem; the size cannot be judged
        return None
    shape = shapes.get(m)
    if not isinstance(shape, EncoderShape):
        return None
    patches = patches_per_image(cfg, shapes) if m == "vision" else DEFAULT_VISION_PATCHES
    tokens = max(1, patches // max(shape.unit, 1))
    elem = 4 if cfg.train.precision == "fp32" else _UNKNOWN_ELEMENT_BYTES
    if cfg.train.precision == "auto" and cfg.train.device == "cpu":
        elem = 4  # auto is fp32 on CPU
    return cfg.data.batch_size * tokens * shape.out_hidden * elem


def _room_for_a_batch(cfg: Config, registry: Registry, m: str, out: Problems) -> None:
    g = getattr(cfg.parallel, m)
    need = one_batch_bytes(cfg, registry, m)
    if need is None or g.feature_cache_gb * 1e9 >= need:
        return
    out.add(
        ("parallel", m, "feature_cache_gb"),
        f"{g.feature_cache_gb:g} GB cannot hold one global batch of {m} outputs ({need / 1e9:.3g} GB: "
        f"data.batch_size {cfg.data.batch_size} x the planning shape's tokens per sample x output "
        f"width x element bytes); allowed: >= {need / 1e9:.3g}",
    )
