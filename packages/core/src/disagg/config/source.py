"""Where each config value came from: a YAML line or a ``--set`` override."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import yaml

Path_ = tuple[str | int, ...]


@dataclass
class SourceMap:
    """Maps key paths (``("parallel", "vision", "degree")``) to their origin."""

    file: str | None = None
    lines: dict[Path_, int] = field(default_factory=dict)
    """Path -> 1-based line of the key (or list item) in ``file``."""
    overrides: dict[Path_, str] = field(default_factory=dict)
    """Path -> the ``key=value`` text of the ``--set`` that wrote it."""

    def where(self, path: Sequence[str | int]) -> str | None:
        """The closest known origin of ``path`` (a missing key points at its section)."""
        path = tuple(path)
        for n in range(len(path), -1, -1):
            prefix = path[:n]
            if prefix in self.overrides:
                return f"--set {self.overrides[prefix]}"
            if prefix in self.lines:
                return f"{self.file}:{self.lines[prefix]}"
        return self.file

    @classmethod
    def from_yaml(cls, text: str, file: str) -> tuple[SourceMap, list[tuple[Path_, int]]]:
        """Line numbers of every key, and the keys that appear twice (YAML
        loaders silently keep the last one, which hides typos)."""
        smap = cls(file=file)
        dupes: list[tuple[Path_, int]] = []
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None:
            _walk(root, (), smap.lines, dupes)
        return smap, dupes


def _walk(node: yaml.Node, path: Path_, lines: dict[Path_, int], dupes: list[tuple[Path_, int]]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[object] = set()
        for key_node, value_node in node.value:
            key = key_node.value
            sub = (*path, key)
            if key in seen:
                dupes.append((sub, key_node.start_mark.line + 1))
            seen.add(key)
            lines[sub] = key_node.start_mark.line + 1
            _walk(value_node, sub, lines, dupes)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            sub = (*path, i)
            lines[sub] = item.start_mark.line + 1
            _walk(item, sub, lines, dupes)


def dotted(path: Sequence[str | int]) -> str:
    return ".".join(str(p) for p in path)
