"""Module shapes for planning, as the families describe them (``Family.planning_shape``)."""

from __future__ import annotations

from typing import Any

from disagg.interfaces.shapes import DecoderShape, Shape


def shapes_for(
    configs: dict[str, dict[str, Any]],
    families: dict[str, str],
    registry: Any = None,
    options: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Shape]:
    """``{module: shape}`` for ``families`` (module -> family name), each read from
    ``configs[module]`` (its model dir's ``config.json`` values; a whole multimodal
    dir's for each of its modules) with ``options[module]``. The LLM comes first so
    that an encoder whose projector takes the LLM's width gets it."""
    if registry is None:
        from disagg.plugins import get_registry

        registry = get_registry()
    out: dict[str, Shape] = {}
    order = sorted(families, key=lambda m: m != "llm")
    for m in order:
        role = "llm" if m == "llm" else "encoder"
        cls = registry.families.get((role, families[m]))
        if cls is None:
            have = sorted(n for r, n in registry.families if r == role)
            raise ValueError(
                f"model.{m}.family: {families[m]!r} is not an installed {role} family; "
                f"have: {', '.join(have)}"
            )
        llm = out.get("llm")
        shape = cls.planning_shape(
            configs[m],
            dict((options or {}).get(m) or {}),
            llm.hidden if isinstance(llm, DecoderShape) else None,
        )
        if shape is None:
            raise ValueError(f"model.{m}.family: family {families[m]!r} describes no shape for planning")
        out[m] = shape
    return {m: out[m] for m in families}
