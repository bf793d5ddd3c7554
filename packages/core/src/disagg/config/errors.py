"""The one exception every config problem becomes, carrying all problems at once."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: where, which key, what and what is allowed."""

    key: str
    """Dotted key (``parallel.vision.degree``); empty for the file as a whole."""
    message: str
    """A sentence naming the bad value and the allowed values."""
    where: str | None = None
    """``path/to/config.yaml:12`` or ``--set train.lr=-1``."""

    def __str__(self) -> str:
        parts = [p for p in (self.where, self.key) if p]
        return ": ".join([*parts, self.message])


class ConfigError(Exception):
    """A config that cannot run; ``problems`` lists every problem found."""

    def __init__(self, problems: Problem | str | Iterable[Problem]) -> None:
        if isinstance(problems, str):
            problems = [Problem("", problems)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems: list[Problem] = list(problems)
        super().__init__(self._render())

    def _render(self) -> str:
        if len(self.problems) == 1:
            return f"config error: {self.problems[0]}"
        lines = [f"{len(self.problems)} config errors:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def did_you_mean(value: object, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` when ``value`` is a near miss of one choice, else ``''``."""
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def allowed(choices: Iterable[str]) -> str:
    """``allowed: a, b, c`` (or a note that nothing is allowed)."""
    items = list(choices)
    return f"allowed: {', '.join(items)}" if items else "nothing is allowed here"
