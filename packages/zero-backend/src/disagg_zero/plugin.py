"""Entry point of the ``disagg`` plugin group: registers the ``zero`` strategy."""

from __future__ import annotations

from typing import Callable

from disagg import hookimpl


@hookimpl
def disagg_register_strategies(register: Callable[[type], None]) -> None:
    # Imported here so that listing plugins does not import DeepSpeed.
    from disagg_zero.strategy import ZeroStrategy

    register(ZeroStrategy)
