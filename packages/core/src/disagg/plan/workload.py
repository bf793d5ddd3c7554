"""A train config as the planner sees it: module shapes, families, the step's workload."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disagg.config.schema import Config
from disagg.interfaces import Family
from disagg.interfaces.cost import Shape, shapes_from_hf_config
from disagg.plan.model import Workload
from disagg.plugins import Registry


def config_shapes(cfg: Config) -> dict[str, Shape]:
    """Each configured module's shape from its model dir's ``config.json``."""
    out: dict[str, Shape] = {}
    for m in cfg.modules():
        spec = getattr(cfg.model, m)
        path = Path(spec.path) / "config.json"
        try:
            shapes = shapes_from_hf_config(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"model.{m}.path: cannot read the shape of {path}: {exc}") from None
        key = "llm" if m == "llm" else "vision"
        if m not in ("vision", "llm") or key not in shapes:
            raise ValueError(
                f"model.{m}: the cost model describes vision towers and decoders only; "
                f"{path} gives {', '.join(shapes) or 'neither'}"
            )
        out[m] = shapes[key]
    return out


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
    return out


def config_workload(
    cfg: Config,
    *,
    vision_tokens: int,
    text_tokens: int,
    samples: int | None = None,
    recompute: bool = False,
    **extra: Any,
) -> Workload:
    return Workload(
        shapes=config_shapes(cfg),
        vision_tokens=vision_tokens,
        text_tokens=text_tokens,
        samples=samples or (cfg.data.batch_size if cfg.data else 1),
        recompute=recompute,
        max_inflight=cfg.train.max_inflight,
        **extra,
    )
