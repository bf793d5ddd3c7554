"""How activations and gradients travel between module groups."""

from __future__ import annotations

from typing import Any, ClassVar


class Transport:
    """Decides the Ray call options of the methods whose results cross groups.

    The driver only ever holds ObjectRefs; a transport changes *how* Ray moves
    the tensors behind them. ``setup`` runs once in the driver after every
    group's actors exist (e.g. to create a Ray collective group over them).
    """

    name: ClassVar[str]
    #: devices it works on: {"cpu"}, {"cuda"} or both
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    #: why it cannot be used in this build, if it cannot (shown at config time)
    unavailable_reason: ClassVar[str | None] = None

    def setup(self, actors: list[Any]) -> None:
        """Prepare the actors of every group (driver side)."""

    def call_options(self) -> dict[str, Any]:
        """Extra ``.options(...)`` for methods that return activations/gradients."""
        return {}

    def teardown(self, actors: list[Any]) -> None:
        """Undo ``setup`` before the actors are killed."""
