"""Test helpers for disagg and for plugin authors (fixtures live in ``fixtures``)."""
