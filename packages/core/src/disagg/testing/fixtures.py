"""pytest fixtures for disagg and for plugin authors.

Loaded automatically by pytest through core's ``pytest11`` entry point, so a
plugin's tests can use them without a conftest::

    def test_my_strategy_registers(disagg_registry):
        reg = disagg.plugins.register_plugin(my_plugin_module)
        assert "my_strategy" in reg.strategies

Imports of Ray happen inside the fixtures: every pytest run in an environment
with disagg installed loads this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pluggy
import pytest

from disagg import plugins


@pytest.fixture
def disagg_plugin_manager() -> pluggy.PluginManager:
    """A fresh plugin manager with the hookspecs and the built-ins only.

    Installed entry points are *not* loaded, so tests do not depend on what
    else happens to be installed; register your plugin on it yourself.
    """
    pm, _ = plugins.make_plugin_manager(load_entry_points=False)
    return pm


@pytest.fixture
def disagg_registry(disagg_plugin_manager: pluggy.PluginManager) -> Iterator[plugins.Registry]:
    """A registry of the built-ins, installed as the process-wide one for the test.

    ``disagg.plugins.register_plugin(obj)`` adds a plugin to it (and returns the
    rebuilt registry); the previous process-wide registry is restored afterwards.
    """
    previous = plugins._REGISTRY  # noqa: SLF001 - restoring exactly what was there, even None
    reg = plugins.build_registry(disagg_plugin_manager)
    plugins.set_registry(reg)
    try:
        yield reg
    finally:
        plugins.set_registry(previous)


@pytest.fixture(scope="session")
def ray_local() -> Iterator[Any]:
    """A local Ray instance shared by the whole test session.

    Started once with 8 logical CPUs (more than the cores, so that several
    small actor groups fit) and no dashboard; an already running instance is
    reused and then left running. Yields the ``ray`` module.
    """
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=8, include_dashboard=False)
    try:
        yield ray
    finally:
        if started and ray.is_initialized():
            ray.shutdown()


# -- the GPU check suite (``nox -s gpu``) ----------------------------------------------------------
GPU_SKIP = "no GPU: skipped"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"gpu: needs a CUDA GPU (nox -s gpu); reported as '{GPU_SKIP}' where none is visible"
    )


def _gpu_visible() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)
    except Exception:  # a torch without CUDA support, a broken driver: no GPU to test on
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu and not _gpu_visible():
        config._disagg_gpu_skipped = len(gpu)  # noqa: SLF001 - read by the summary below
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=GPU_SKIP))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    n = getattr(config, "_disagg_gpu_skipped", 0)
    if n:
        terminalreporter.write_line(f"{GPU_SKIP} ({n} gpu-marked tests)")
