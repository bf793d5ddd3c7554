"""Plugin loading: built-ins, DISAGG_PLUGINS, broken plugins, conflicts, observers, fixtures."""

from __future__ import annotations

import importlib.metadata as md
import json
import textwrap

import pytest

from disagg import plugins
from disagg.cli import main as cli
from disagg.plugins import build_registry, make_plugin_manager, notify, register_plugin

GOOD = """
import disagg
from disagg.builtin.ddp import DDPStrategy

class {cls}(DDPStrategy):
    name = "{strategy}"

@disagg.hookimpl
def disagg_register_strategies(register):
    register({cls})
"""


@pytest.fixture
def fake_entry_points(tmp_path, monkeypatch):
    """Installs fake entry points of group ``disagg`` (modules written to tmp_path)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    eps: list[md.EntryPoint] = []

    def add(name: str, source: str | None = None, value: str | None = None) -> None:
        if source is not None:
            module = f"fakeplug_{name}"
            (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
            value = module
        eps.append(md.EntryPoint(name=name, value=value, group="disagg"))

    def entry_points(**kw):
        return [ep for ep in eps if ep.group == kw.get("group")]

    monkeypatch.setattr(md, "entry_points", entry_points)
    monkeypatch.delenv("DISAGG_PLUGINS", raising=False)
    return add


def load() -> plugins.Registry:
    return build_registry(*make_plugin_manager())


def test_builtins_are_registered_through_the_hooks(disagg_registry):
    assert "ddp" in disagg_registry.strategies
    assert {"object_store", "gloo", "nccl"} <= set(disagg_registry.transports)
    info = disagg_registry.plugins["disagg.builtin"]
    assert info.registered["strategies"] == ["ddp"]
    assert {"object_store", "gloo", "nccl"} <= set(info.registered["transports"])
    assert {"disagg_register_strategies", "disagg_register_transports"} <= set(info.hooks) and info.version


def test_entry_points_load_and_disagg_plugins_limits(fake_entry_points, monkeypatch):
    fake_entry_points("one", GOOD.format(cls="One", strategy="one_sp"))
    fake_entry_points("two", GOOD.format(cls="Two", strategy="two_sp"))
    reg = load()
    assert {"one", "two"} <= set(reg.plugins) and {"one_sp", "two_sp"} <= set(reg.strategies)
    monkeypatch.setenv("DISAGG_PLUGINS", "two")
    reg = load()
    assert "one" not in reg.plugins and "one_sp" not in reg.strategies and "two_sp" in reg.strategies
    monkeypatch.setenv("DISAGG_PLUGINS", "")
    reg = load()
    assert all(name.startswith("disagg.") for name in reg.plugins)
    assert {"one_sp", "two_sp"}.isdisjoint(reg.strategies)


def test_broken_plugin_is_reported_not_fatal(fake_entry_points):
    fake_entry_points("good", GOOD.format(cls="Good", strategy="good_sp"))
    fake_entry_points("broken", value="disagg_no_such_module_xyz")
    fake_entry_points("raises", "raise ImportError('needs libfoo')\n")
    with pytest.warns(UserWarning, match="'broken' failed to load"):
        reg = load()
    assert "good_sp" in reg.strategies
    assert reg.failures["broken"].startswith("ModuleNotFoundError")
    assert reg.failures["raises"] == "ImportError: needs libfoo"
    assert "broken" not in reg.plugins


def test_plugin_failing_inside_its_register_hook(fake_entry_points):
    fake_entry_points(
        "halfway",
        """
        import disagg

        @disagg.hookimpl
        def disagg_register_families(register):
            raise RuntimeError("cannot read family table")
        """,
    )
    fake_entry_points("good", GOOD.format(cls="Good", strategy="good_sp"))
    with pytest.warns(UserWarning, match="halfway"):
        reg = load()
    assert "good_sp" in reg.strategies
    assert reg.failures["halfway"] == "RuntimeError: cannot read family table (in disagg_register_families)"


def test_duplicate_name_names_both_plugins(fake_entry_points):
    fake_entry_points("first", GOOD.format(cls="A", strategy="same"))
    fake_entry_points("second", GOOD.format(cls="B", strategy="same"))
    with pytest.raises(
        plugins.PluginConflict,
        match="strategy 'same' is registered by plugin 'first' and again by plugin 'second'",
    ):
        load()


def test_unknown_hook_name_fails_check_pending(fake_entry_points):
    fake_entry_points(
        "typo", "import disagg\n\n@disagg.hookimpl\ndef disagg_register_strategy(register):\n    pass\n"
    )
    with pytest.raises(Exception, match="disagg_register_strategy"):
        load()


def test_plugins_command_lists_failures(fake_entry_points, capsys, monkeypatch):
    fake_entry_points("good", GOOD.format(cls="Good", strategy="good_sp"))
    fake_entry_points("broken", value="disagg_no_such_module_xyz")
    monkeypatch.setattr(plugins, "_REGISTRY", None)
    with pytest.warns(UserWarning):
        assert cli.main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    by_name = {p["name"]: p for p in data["plugins"]}
    assert by_name["good"]["registered"] == {"strategies": ["good_sp"]}
    assert by_name["good"]["hooks"] == ["disagg_register_strategies"]
    assert data["failed"] == [{"name": "broken", "error": data["failed"][0]["error"]}]
    assert "disagg_no_such_module_xyz" in data["failed"][0]["error"]
    assert cli.main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "broken FAILED" in text and "strategies: good_sp" in text
    monkeypatch.setattr(plugins, "_REGISTRY", None)


def test_notify_survives_a_broken_observer(disagg_registry):
    seen = []

    class Logger:
        @staticmethod
        @plugins_hookimpl()
        def disagg_log_metrics(step, metrics):
            seen.append((step, metrics["loss"]))

    class Broken:
        @staticmethod
        @plugins_hookimpl()
        def disagg_log_metrics(step, metrics):
            raise OSError("disk full")

    register_plugin(Logger, name="logger")
    register_plugin(Broken, name="broken")
    with pytest.warns(UserWarning, match="disk full"):
        errors = notify("disagg_log_metrics", step=3, metrics={"loss": 1.5})
    assert seen == [(3, 1.5)]
    assert len(errors) == 1 and "'broken'" in errors[0]
    finished = []

    class Summary:
        @staticmethod
        @plugins_hookimpl()
        def disagg_run_finished(summary):
            finished.append(summary["status"])

    register_plugin(Summary, name="summary")
    assert notify("disagg_run_finished", summary={"status": "ok"}) == []
    assert finished == ["ok"]


def plugins_hookimpl():
    import disagg

    return disagg.hookimpl


def test_disagg_registry_fixture_restores_previous(disagg_registry):
    assert plugins.get_registry() is disagg_registry
    new = register_plugin(type("P", (), {}), name="empty")
    assert plugins.get_registry() is new and "empty" in new.plugins


def test_fresh_plugin_manager_has_builtins_only(disagg_plugin_manager):
    names = {name for name, _ in disagg_plugin_manager.list_name_plugin()}
    assert "disagg.builtin" in names and all(n.startswith("disagg.") for n in names)
    assert disagg_plugin_manager.hook.disagg_log_metrics.spec is not None


def test_known_providers_name_first_party_distributions():
    assert set(plugins.KNOWN_PROVIDERS.values()) <= {
        "disagg-vision-sp",
        "disagg-llm-tp",
        "disagg-zero",
        "disagg-audio",
    }
    assert plugins.provider_of("strategy", "megatron_tp") == "disagg-llm-tp"
    assert plugins.provider_of("family", "llava", "encoder") == "disagg-vision-sp"
    assert plugins.provider_of("strategy", "nope") is None
