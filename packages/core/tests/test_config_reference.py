"""docs/configuration.md's config reference is generated from the schema's field docstrings and in sync."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from disagg.config import schema
from disagg.config.reference import END, PAGE, START, render, sync

REFERENCE = Path(__file__).resolve().parents[3] / PAGE


def test_reference_page_is_in_sync():
    assert sync(REFERENCE, write=False), f"{PAGE} is stale: run python -m disagg.config.reference {PAGE}"


def test_every_field_is_documented():
    missing = [
        f"{model.__name__}.{name}"
        for model in vars(schema).values()
        if isinstance(model, type) and issubclass(model, BaseModel) and model.__module__ == schema.__name__
        for name, field in model.model_fields.items()
        if not field.description
    ]
    assert missing == [], f"fields without a docstring: {missing}"


def test_reference_covers_nested_keys():
    text = render()
    for key in (
        "model.<module>.path",
        "parallel.<module>.degree",
        "data.train[].weight",
        "train.modules.<module>.freeze",
        "ray.address",
        "output_dir",
    ):
        assert f"`{key}`" in text, key
    assert START in REFERENCE.read_text() and END in REFERENCE.read_text()
