"""The plugin manager: entry points in group ``disagg``, built-ins, and the registry.

Entry points are loaded lazily (on the first :func:`get_registry`), limited by
``DISAGG_PLUGINS=a,b`` (entry-point names), and a plugin that fails to import is
recorded in :attr:`Registry.failures` and warned about instead of crashing.

Which distribution a plugin came from (its version in ``disagg plugins``) is kept
here, from the entry points loaded (:attr:`PluginManager.distributions`), not in
pluggy's private bookkeeping.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pluggy

from disagg import hookspecs

GROUP = "disagg"

#: Strategies and families shipped by first-party plugins, so that naming one
#: that is not installed gets the install line instead of "unknown". Written out
#: (the hint is for when the plugin is *not* installed); ``tests/test_providers.py``
#: asserts it equals :func:`providers_from` the first-party packages' registrations.
KNOWN_PROVIDERS: dict[str, str] = {
    "strategy:ulysses": "disagg-vision-sp",
    "strategy:megatron_tp": "disagg-llm-tp",
    "strategy:zero": "disagg-zero",
    "family:encoder:qwen2_5_vl": "disagg-vision-sp",
    "family:encoder:qwen2_vl": "disagg-vision-sp",
    "family:encoder:qwen3_vl": "disagg-vision-sp",
    "family:encoder:qwen3_5": "disagg-vision-sp",
    "family:encoder:llava": "disagg-vision-sp",
    "family:encoder:qwen2_5_omni": "disagg-vision-sp",
    "family:encoder:internvl": "disagg-vision-sp",
    "family:encoder:whisper": "disagg-audio",
    "family:encoder:qwen2_audio": "disagg-audio",
    "family:encoder:qwen2_5_omni_audio": "disagg-audio",
    "family:llm:qwen2_5_vl": "disagg-llm-tp",
    "family:llm:qwen2_vl": "disagg-llm-tp",
    "family:llm:qwen3_vl": "disagg-llm-tp",
    "family:llm:qwen3_5": "disagg-llm-tp",
    "family:llm:qwen2": "disagg-llm-tp",
    "family:llm:llama": "disagg-llm-tp",
    "family:llm:qwen2_audio": "disagg-llm-tp",
    "family:llm:qwen2_5_omni": "disagg-llm-tp",
    "family:llm:internvl": "disagg-llm-tp",
}


@dataclass
class PluginInfo:
    name: str
    version: str | None
    #: the distribution that installed it (None: registered by hand)
    distribution: str | None = None
    hooks: list[str] = field(default_factory=list)
    registered: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class Registry:
    strategies: dict[str, type] = field(default_factory=dict)
    #: keyed by (role, name)
    families: dict[tuple[str, str], type] = field(default_factory=dict)
    transports: dict[str, type] = field(default_factory=dict)
    schedules: dict[str, type] = field(default_factory=dict)
    trackers: dict[str, type] = field(default_factory=dict)
    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    #: plugin name -> "ExceptionType: message" for plugins that failed to load
    failures: dict[str, str] = field(default_factory=dict)
    pm: pluggy.PluginManager | None = None

    def family(self, role: str, name: str) -> type:
        return self.families[(role, name)]

    def transport_names(self) -> list[str]:
        return sorted(self.transports)


class PluginManager(pluggy.PluginManager):
    """pluggy's manager plus the distribution of each plugin loaded from an entry point."""

    def __init__(self, project_name: str) -> None:
        super().__init__(project_name)
        #: plugin name (entry-point name) -> the distribution that declares its entry point
        self.distributions: dict[str, md.Distribution] = {}


def make_plugin_manager(load_entry_points: bool = True) -> tuple[PluginManager, dict[str, str]]:
    """A fresh manager with the built-ins and (optionally) installed plugins."""
    from disagg import builtin

    pm = PluginManager(GROUP)
    pm.add_hookspecs(hookspecs)
    pm.register(builtin, name="disagg.builtin")
    failures: dict[str, str] = {}
    if load_entry_points:
        only = _allowed()
        for ep in md.entry_points(group=GROUP):
            if only is not None and ep.name not in only:
                continue
            if pm.has_plugin(ep.name):
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin must not take the others down
                failures[ep.name] = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"disagg plugin {ep.name!r} failed to load: {exc}", stacklevel=2)
                continue
            try:
                pm.register(plugin, name=ep.name)
            except Exception as exc:  # e.g. the same module under two entry-point names
                failures[ep.name] = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"disagg plugin {ep.name!r} could not be registered: {exc}", stacklevel=2)
                continue
            if ep.dist is not None:
                pm.distributions[ep.name] = ep.dist
    # An implementation whose name matches no hookspec is a typo in a plugin:
    # fail loudly now rather than silently never calling it.
    pm.check_pending()
    return pm, failures


def _allowed() -> set[str] | None:
    raw = os.environ.get("DISAGG_PLUGINS")
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def build_registry(pm: pluggy.PluginManager, failures: dict[str, str] | None = None) -> Registry:
    """Ask every plugin to register; remember who registered what.

    A plugin whose register hook raises is recorded in ``failures`` (and warned
    about) like one that failed to import; the others still register.
    Registering a name that another plugin already registered is an error
    naming both plugins.
    """
    reg = Registry(failures=dict(failures or {}), pm=pm)
    # a plain pluggy manager (built by hand) knows no distributions
    dists: dict[str, md.Distribution] = getattr(pm, "distributions", {})
    for name, plugin in pm.list_name_plugin():
        if plugin is None:
            continue
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        dist = dists.get(name)
        reg.plugins[name] = PluginInfo(
            name=name,
            version=dist.version if dist is not None else _builtin_version(name),
            hooks=hooks,
            distribution=dist.metadata["Name"] if dist is not None else _builtin_distribution(name),
        )
    owners: dict[tuple[str, Any], str] = {}

    def collector(kind: str, table: dict, plugin_name: str) -> Any:
        def register(cls: type) -> None:
            if kind == "families":
                key: Any = (cls.role, cls.name)
                label = f"{cls.role}:{cls.name}"
            else:
                key = label = cls.name
            if key in table and table[key] is not cls:
                raise PluginConflict(
                    f"{_SINGULAR[kind]} {label!r} is registered by plugin {owners[(kind, key)]!r} "
                    f"and again by plugin {plugin_name!r}; uninstall one of them or limit "
                    "DISAGG_PLUGINS"
                )
            table[key] = cls
            owners[(kind, key)] = plugin_name
            reg.plugins[plugin_name].registered.setdefault(kind, []).append(label)

        return register

    for kind, hook in REGISTER_HOOKS:
        table = getattr(reg, kind)
        # get_hookimpls() is in registration order (built-ins first), so the
        # first registrant of a name is the one a conflict message names first.
        for impl in getattr(pm.hook, hook).get_hookimpls():
            try:
                impl.function(register=collector(kind, table, impl.plugin_name))
            except PluginConflict:
                raise
            except Exception as exc:  # one broken plugin must not take the others down
                reg.failures[impl.plugin_name] = f"{type(exc).__name__}: {exc} (in {hook})"
                warnings.warn(f"disagg plugin {impl.plugin_name!r} failed in {hook}: {exc}", stacklevel=2)
    return reg


class PluginConflict(RuntimeError):
    """Two plugins registered the same strategy, family or transport name."""


_SINGULAR = {
    "strategies": "strategy",
    "families": "family",
    "transports": "transport",
    "schedules": "schedule",
    "trackers": "tracker",
}

#: (Registry attribute, hook that fills it)
REGISTER_HOOKS: tuple[tuple[str, str], ...] = (
    ("strategies", "disagg_register_strategies"),
    ("families", "disagg_register_families"),
    ("transports", "disagg_register_transports"),
    ("schedules", "disagg_register_schedules"),
    ("trackers", "disagg_register_trackers"),
)


def providers_from(registry: Registry, distributions: set[str]) -> dict[str, str]:
    """``KNOWN_PROVIDERS``' entries as the installed plugins of ``distributions``
    registered them: ``strategy:<name>`` / ``family:<role>:<name>`` -> distribution."""
    out = {}
    for info in registry.plugins.values():
        dist = info.distribution
        if dist not in distributions:
            continue
        out.update({f"strategy:{s}": dist for s in info.registered.get("strategies", [])})
        out.update({f"family:{f}": dist for f in info.registered.get("families", [])})
    return out


def provider_of(kind: str, name: str, role: str | None = None) -> str | None:
    """The first-party distribution that provides ``name`` (``kind`` is
    ``strategy`` or ``family``), for "pip install ..." hints."""
    key = f"{kind}:{role}:{name}" if role else f"{kind}:{name}"
    return KNOWN_PROVIDERS.get(key)


def install_command(dist: str, core: md.Distribution | None = None) -> str:
    """The command that installs first-party ``dist`` the way disagg itself was installed.

    The plugins are on no package index; a user installs them from a checkout. When
    ``disagg-core`` (``core``, default the installed one) came from a local directory
    (``pip install [-e] <checkout>/packages/core``: its ``direct_url.json``), the
    sibling directory whose ``pyproject.toml`` names ``dist`` is the answer, with ``-e``
    when core is editable; otherwise the distribution name."""
    if core is None:
        try:
            core = md.distribution("disagg-core")
        except md.PackageNotFoundError:
            core = None
    try:
        direct = json.loads((core.read_text("direct_url.json") if core is not None else None) or "{}")
    except ValueError:
        direct = {}
    url = direct.get("url", "")
    if url.startswith("file://"):
        from urllib.parse import unquote, urlparse

        packages = Path(unquote(urlparse(url).path)).parent
        editable = "-e " if direct.get("dir_info", {}).get("editable") else ""
        for pyproject in sorted(packages.glob("*/pyproject.toml")):
            if _project_name(pyproject) == dist:
                return f"pip install {editable}{pyproject.parent}"
    return f"pip install {dist}"


def _project_name(pyproject: Path) -> str | None:
    """``[project] name`` (a regex: ``tomllib`` is not in Python 3.10)."""
    m = re.search(r'^\[project\][^\[]*?^name\s*=\s*"([^"]+)"', pyproject.read_text(), re.M | re.S)
    return m.group(1) if m else None


def notify(hook: str, *, pm: pluggy.PluginManager | None = None, **kwargs: Any) -> list[str]:
    """Call an observer hook (``disagg_run_started``, ``disagg_log_metrics``, ``disagg_run_finished``)
    on every plugin of ``pm`` (default: the process-wide registry's); an
    exception in one plugin is warned about and returned, never raised, so
    that a broken logger cannot stop a run."""
    if pm is None:
        pm = get_registry().pm
    assert pm is not None
    errors: list[str] = []
    for impl in getattr(pm.hook, hook).get_hookimpls():
        try:
            impl.function(**{k: kwargs[k] for k in impl.argnames})
        except Exception as exc:
            msg = f"plugin {impl.plugin_name!r} failed in {hook}: {type(exc).__name__}: {exc}"
            warnings.warn(msg, stacklevel=2)
            errors.append(msg)
    return errors


def _builtin_distribution(name: str) -> str | None:
    return "disagg-core" if name.startswith("disagg.") else None


def _builtin_version(name: str) -> str | None:
    from disagg import __version__

    return __version__ if name.startswith("disagg.") else None


_REGISTRY: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, created on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        pm, failures = make_plugin_manager()
        _REGISTRY = build_registry(pm, failures)
    return _REGISTRY


def set_registry(reg: Registry | None) -> None:
    """Replace the process-wide registry (tests; ``None`` forces a reload)."""
    global _REGISTRY
    _REGISTRY = reg


def register_plugin(plugin: Any, name: str | None = None) -> Registry:
    """Add a plugin object to the current registry (tests, notebooks)."""
    reg = get_registry()
    assert reg.pm is not None
    reg.pm.register(plugin, name=name)
    rebuilt = build_registry(reg.pm, reg.failures)
    set_registry(rebuilt)
    return rebuilt
