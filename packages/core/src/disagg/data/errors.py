"""The one error type of the data pipeline: always names where the bad sample is."""

from __future__ import annotations


class DataError(ValueError):
    """A bad dataset file or sample.

    The message starts with the location (``train.jsonl:17`` for JSONL,
    ``train.json[3]`` for a JSON list) so that a user can open the file at the
    right place; ``location`` and ``problem`` keep the two parts apart for
    callers that count or report skips.
    """

    def __init__(self, location: str, problem: str) -> None:
        super().__init__(f"{location}: {problem}" if location else problem)
        self.location = location
        self.problem = problem

    def __reduce__(self):  # Ray pickles exceptions raised in workers
        return (type(self), (self.location, self.problem))
