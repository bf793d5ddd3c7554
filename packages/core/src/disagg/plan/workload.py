"""A train config as the planner sees it: module shapes, families, the step's workload.

Vision sizes have two units: *vision tokens*, the merged rows the LLM sees per sample
(what ``disagg data check`` prints, and what ``data.max_pixels`` bounds), and *patches*,
the positions the vision encoder attends over (``tokens x merge²`` on Qwen2.5-VL).
:class:`~disagg.plan.model.Workload` holds patches; :func:`patches_per_image` converts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disagg.config.schema import Config
from disagg.cost.shapes import shapes_for
from disagg.interfaces import EncoderShape, Family
from disagg.interfaces.cost import Shape
from disagg.interfaces.family import link_to_llm
from disagg.interfaces.lora import LoraSpec
from disagg.plan.feature_cache import encoded_shares
from disagg.plan.model import Workload
from disagg.plugins import Registry


def config_shapes(cfg: Config, registry: Registry | None = None) -> dict[str, Shape]:
    """Each configured module's shape, as its family describes it from its model dir's ``config.json``."""
    configs, families, options = {}, {}, {}
    for m in cfg.modules():
        spec = getattr(cfg.model, m)
        path = Path(spec.path) / "config.json"
        try:
            configs[m] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"model.{m}.path: cannot read {path}: {exc}") from None
        families[m], options[m] = spec.family, spec.options
    try:
        return shapes_for(configs, families, registry, options)
    except ValueError as exc:
        raise ValueError(
            f"{exc} (model dirs: {', '.join(getattr(cfg.model, m).path for m in families)})"
        ) from None


def config_families(cfg: Config, registry: Registry) -> dict[str, Family]:
    """Family instances (for the strategies' and families' own mesh checks), where they load."""
    out = {}
    for m in cfg.modules():
        spec = getattr(cfg.model, m)
        role = "llm" if m == "llm" else "encoder"
        cls = registry.families.get((role, spec.family))
        if cls is None:
            continue
        try:
            out[m] = cls(spec.path, spec.options)
        except Exception:  # validation reports it; the planner then uses the shape's rule
            continue
    try:  # an encoder sized by the LLM (a projector to its width) learns it as in a run
        link_to_llm(out)
    except Exception:  # the LLM family could not say: the encoder's own check names the option
        pass
    return out


def config_training(
    cfg: Config, registry: Registry | None = None
) -> tuple[dict[str, LoraSpec], dict[str, tuple[str, ...]]]:
    """Per module, ``train.modules.<m>.lora`` resolved and the frozen parts' patterns
    (``freeze: true``: every parameter), as the run resolves them (``optim_for``)."""
    from disagg.runtime.plan import optim_for

    if registry is None:
        from disagg.plugins import get_registry

        registry = get_registry()
    families = config_families(cfg, registry)
    lora: dict[str, LoraSpec] = {}
    frozen: dict[str, tuple[str, ...]] = {}
    for m in cfg.modules():
        o = cfg.train.modules.get(m)
        if o is None:
            continue
        spec = optim_for(cfg, m, families.get(m))
        if spec is None:
            frozen[m] = ("*",)
            continue
        if spec.lora is not None:
            lora[m] = spec.lora
        patterns = tuple(p for _, ps in spec.frozen for p in ps)
        if patterns:
            frozen[m] = patterns
    return lora, frozen


#: patches per image a plan assumes when neither a size nor ``data.max_pixels`` says
DEFAULT_VISION_PATCHES = 1024


def patches_per_image(
    cfg: Config,
    shapes: dict[str, Shape],
    *,
    vision_tokens: int | None = None,
    patches: int | None = None,
) -> int:
    """Patches per image entering the vision encoder.

    ``vision_tokens``: merged tokens the LLM sees (``patches = tokens x unit``);
    ``patches``: as given. Neither: the most one image gives under ``data.max_pixels``
    (one token per ``(patch x merge)²`` pixels, as the Qwen2.5-VL processor resizes), else
    :data:`DEFAULT_VISION_PATCHES`."""
    if vision_tokens is not None and patches is not None:
        raise ValueError("give vision tokens or vision patches, not both")
    shape = shapes.get("vision")
    unit = shape.unit if isinstance(shape, EncoderShape) else 1
    if patches is not None:
        return patches
    if vision_tokens is not None:
        return vision_tokens * unit
    max_pixels = cfg.data.max_pixels if cfg.data else None
    if isinstance(shape, EncoderShape) and shape.patch and max_pixels:
        side = shape.patch * shape.merge
        return (max_pixels // (side * side)) * unit
    return DEFAULT_VISION_PATCHES


def config_workload(
    cfg: Config,
    *,
    text_tokens: int,
    vision_tokens: int | None = None,
    vision_patches: int | None = None,
    samples: int | None = None,
    recompute: bool = False,
    registry: Registry | None = None,
    **extra: Any,
) -> Workload:
    """The step ``cfg`` trains, for the planner. ``vision_tokens`` (merged, per sample) or
    ``vision_patches`` (per image) size the vision input; neither: see :func:`patches_per_image`."""
    lora, frozen = config_training(cfg, registry)
    shapes = config_shapes(cfg, registry)
    patches = patches_per_image(cfg, shapes, vision_tokens=vision_tokens, patches=vision_patches)
    return Workload(
        shapes=shapes,
        lora=lora,
        frozen=frozen,
        precision=None if cfg.train.precision == "auto" else cfg.train.precision,
        vision_tokens=patches,
        text_tokens=text_tokens,
        samples=samples or (cfg.data.batch_size if cfg.data else 1),
        recompute=recompute,
        max_inflight=cfg.train.max_inflight,
        strategy_keys=True,
        encoded=encoded_shares(cfg),
        **extra,
    )
