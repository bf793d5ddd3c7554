"""disagg-audio installs next to core and loads as a plugin."""

import importlib.metadata as md

from disagg.plugins import build_registry, make_plugin_manager


def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in md.entry_points(group="disagg")}
    assert eps.get("audio") == "disagg_audio.plugin"


def test_loads_without_failure(monkeypatch):
    monkeypatch.setenv("DISAGG_PLUGINS", "audio")
    reg = build_registry(*make_plugin_manager())
    assert "audio" in reg.plugins
    assert reg.failures == {}
    assert reg.plugins["audio"].version == md.version("disagg-audio")
