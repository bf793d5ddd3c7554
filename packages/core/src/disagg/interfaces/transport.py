"""How activations and gradients travel between module groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Layout:
    """What a transport needs to know to say whether it can work: the device,
    the placement and each module group's rank count (degree x replicas)."""

    device: str
    placement: str
    ranks: dict[str, int]

    @property
    def one_gpu(self) -> bool:
        """Every rank of every group on one device (collocated, one rank each):
        each encoder rank's consumers share its GPU."""
        return self.placement == "collocated" and max(self.ranks.values(), default=1) == 1


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
    #: tensors stay on the producer's device and Ray moves them device to device
    #: (Ray Direct Transport); otherwise they are sent from host memory
    on_device: ClassVar[bool] = False

    @classmethod
    def refuse(cls, layout: Layout) -> str | None:
        """Why this transport cannot work in ``layout`` (a sentence with the
        alternatives), or ``None``; asked at validation, before any actor starts."""
        return None

    def setup(self, actors: list[Any]) -> None:
        """Prepare the actors of every group (driver side)."""

    def call_options(self) -> dict[str, Any]:
        """Extra ``.options(...)`` for methods that return activations/gradients."""
        return {}

    def teardown(self, actors: list[Any]) -> None:
        """Undo ``setup`` before the actors are killed."""
