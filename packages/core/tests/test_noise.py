"""Known third-party noise is dropped where it is made (``disagg.noise``), in the driver and
in Ray workers, and nothing else is; ``--verbose`` shows it all."""

from __future__ import annotations

import logging
import os
import warnings

import pytest

from disagg import noise

MEGATRON = (
    "When using async grad allreduce it is recommended to set the environment variable "
    "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup"
)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def quiet(monkeypatch):
    """A process with the filters installed; the driver's state restored afterwards."""
    monkeypatch.delenv(noise.VERBOSE_ENV, raising=False)
    with warnings.catch_warnings():
        warnings.resetwarnings()  # only disagg's filters (not pytest's -W / filterwarnings)
        noise.install()
        yield
    os.environ.pop(noise.VERBOSE_ENV, None)  # --verbose set it (not through monkeypatch)
    for logger, drop in list(noise._installed):
        logger.removeFilter(drop)
    noise._installed.clear()
    noise.install()


def _logged(name: str, *messages: str) -> list[str]:
    logger, handler = logging.getLogger(name), _Collect()
    logger.addHandler(handler)
    try:
        for m in messages:
            logger.warning(m)
    finally:
        logger.removeHandler(handler)
    return handler.messages


def test_known_noise_is_dropped_and_the_rest_kept(quiet):
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn(MEGATRON, UserWarning, stacklevel=1)
        warnings.warn("a warning disagg does not know", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a warning disagg does not know"]
    got = _logged("ray._private.worker", "Started a local Ray instance.", "Connected to Ray cluster.")
    assert got == ["Connected to Ray cluster."]
    got = _logged(
        "ray.data._internal.execution.streaming_executor",
        "✔️  Dataset dataset_1_0 execution finished in 3.1 seconds",
        "⚠️  Dataset dataset_1_0 execution failed",
    )
    assert got == ["⚠️  Dataset dataset_1_0 execution failed"]


def test_verbose_shows_everything(quiet, monkeypatch):
    from disagg.cli.main import main

    assert main(["plugins", "--json", "--verbose"]) == 0
    assert noise.verbose()
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn(MEGATRON, UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == [MEGATRON]
    started = "Started a local Ray instance."
    assert _logged("ray._private.worker", started) == [started]


def test_ray_workers_filter_too(ray_local):
    """A Ray task imports disagg to run disagg code: the filters hold there as well."""
    import ray

    @ray.remote(num_cpus=0)
    def warn_in_worker() -> list[str]:
        import disagg  # noqa: F401  (what every actor and data task does)

        with warnings.catch_warnings(record=True) as caught:
            warnings.warn(MEGATRON, UserWarning, stacklevel=1)
            warnings.warn("kept", UserWarning, stacklevel=1)
        return [str(w.message) for w in caught]

    assert ray.get(warn_in_worker.remote()) == ["kept"]
