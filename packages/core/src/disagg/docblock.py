"""A generated block inside a hand-written docs page (the config and metrics references):
the page keeps its prose, and only the text between two marker comments is rewritten."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def sync_block(page: Path, start: str, end: str, render: Callable[[], str], write: bool) -> bool:
    """Whether ``page``'s block between ``start`` and ``end`` equals ``render()``; with
    ``write``, make it so."""
    text = page.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{page}: markers {start!r} and {end!r} not found")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    new = f"{head}{start}\n\n{render()}\n{end}{tail}"
    if write and new != text:
        page.write_text(new)
    return new == text
