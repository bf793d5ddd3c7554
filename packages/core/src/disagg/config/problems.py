"""What one validation collects: every problem, in the order found, each located.

Each concern's checks (``*_checks.py``) add to one :class:`Problems`, so that
:func:`disagg.config.validate.validate` raises them all together; a check that needs
to know whether its own part went wrong compares ``len`` before and after.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from disagg.config.errors import Problem
from disagg.config.source import SourceMap, dotted


class Problems:
    """The problems found so far, located by ``source`` (a YAML line or ``--set``)."""

    def __init__(self, source: SourceMap | None) -> None:
        self.source = source
        self.found: list[Problem] = []

    def add(self, path: Sequence[str | int], message: str) -> None:
        where = self.source.where(path) if self.source else None
        self.found.append(Problem(dotted(path), message, where))

    def add_all(self, found: Iterable[tuple[Sequence[str | int], str]]) -> None:
        """``(key path, message)`` pairs, as the checks shared with the plan return them."""
        for path, message in found:
            self.add(path, message)

    def extend(self, problems: Iterable[Problem]) -> None:
        """Problems already located (pydantic's errors, :mod:`disagg.config.translate`)."""
        self.found += problems

    def __len__(self) -> int:
        return len(self.found)
