"""The data stream read some global batches ahead of training (``parallel.<m>.feature_cache_ahead``),
so that a cached frozen encoder can work on the next batches while the LLM trains. A checkpoint
must still name where the *trained* batches end: ``state()`` and ``stats()`` are the stream's as
of the batch last handed out, not of the batches read ahead."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class _Read:
    batch: list[Any]
    state: dict[str, Any] | None
    stats: dict[str, int]


class Lookahead:
    """``batches`` of ``source`` read ``ahead`` batches early, at most ``total`` in all; iterating
    gives ``(batch, the batches after it that were read)``."""

    def __init__(self, source: Any, batches: Iterator[list[Any]], ahead: int, total: int) -> None:
        self.source, self.ahead, self.left = source, ahead, total
        self._it = iter(batches)
        self._buf: deque[_Read] = deque()
        self._current: _Read | None = None

    def __iter__(self) -> Iterator[tuple[list[Any], list[list[Any]]]]:
        while True:
            while len(self._buf) < self.ahead + 1 and self.left > 0:
                try:
                    batch = next(self._it)
                except StopIteration:
                    self.left = 0
                    break
                self.left -= 1
                state = self.source.state() if hasattr(self.source, "state") else None
                self._buf.append(_Read(batch, state, dict(self.source.stats())))
            if not self._buf:
                return
            self._current = self._buf.popleft()
            yield self._current.batch, [r.batch for r in self._buf]

    def state(self) -> dict[str, Any] | None:
        return self._current.state if self._current is not None else None

    def stats(self) -> dict[str, int]:
        return self._current.stats if self._current is not None else dict(self.source.stats())

    def close(self) -> None:
        if hasattr(self._it, "close"):
            self._it.close()
