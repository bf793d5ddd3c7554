"""The install hints (``disagg.plugins.KNOWN_PROVIDERS``) are exactly what the
first-party packages register: a strategy or family added, renamed or removed in
a package without updating the hints fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def first_party_distributions() -> set[str]:
    names = set()
    for pyproject in (ROOT / "packages").glob("*/pyproject.toml"):
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
        if name != "disagg-core":
            names.add(name)
    return names


def test_known_providers_are_the_first_party_registrations():
    from disagg import plugins

    dists = first_party_distributions()
    assert dists == set(plugins.KNOWN_PROVIDERS.values())
    registry = plugins.get_registry()
    installed = {p.distribution for p in registry.plugins.values()}
    if not dists <= installed:
        pytest.skip(f"not every first-party package is installed: missing {sorted(dists - installed)}")
    assert plugins.KNOWN_PROVIDERS == plugins.providers_from(registry, dists)
