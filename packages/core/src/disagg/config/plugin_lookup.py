"""A strategy or family named in the config, looked up among the installed plugins.

A name that is not there is one problem saying why: registered for another role,
provided by a plugin that is not installed (with the ``pip install`` line), or unknown
(with what is installed and, for a strategy, the near miss).
"""

from __future__ import annotations

import difflib
import os
import re
from typing import Any

from disagg.config.errors import allowed, did_you_mean
from disagg.config.problems import Problems
from disagg.plugins import install_command


def lookup(
    out: Problems,
    path: tuple,
    what: str,
    name: str,
    table: dict[str, Any],
    provider: str | None,
    others: set[str] | None = None,
) -> Any:
    """``table[name]``, or None with the problem added. ``others``: names registered for
    another role (a family named under the wrong module)."""
    if name in table:
        return table[name]
    names = sorted(table)
    if others and name in others:
        out.add(
            path,
            f"{name!r} is not an {what} (it is registered for another role); installed "
            f"{what.replace('family', 'families')}: {', '.join(names) or 'none'}",
        )
    elif provider is not None:
        out.add(
            path,
            f"{what} {name!r} is provided by {provider}, which is not installed or not loaded; "
            f"run: {install_command(provider)}{_limited_hint()}",
        )
    elif others is not None:  # a family: name what is installed, never another model version
        out.add(
            path,
            f"unknown {what} {name!r}; installed {what.replace('family', 'families')}: "
            f"{', '.join(names) or 'none'}"
            f"{_same_version_hint(name, names)}",
        )
    else:
        out.add(path, f"unknown {what} {name!r}; {allowed(names)}{did_you_mean(name, names)}")
    return None


def _limited_hint() -> str:
    limit = os.environ.get("DISAGG_PLUGINS")
    return f" (DISAGG_PLUGINS={limit!r} limits which installed plugins load)" if limit is not None else ""


def _same_version_hint(name: str, names: list[str]) -> str:
    """A did-you-mean that never offers another version of a model (``qwen3_vl`` is
    not a typo of ``qwen2_5_vl``, and that family cannot load it)."""
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if close and re.findall(r"\d+", close[0]) == re.findall(r"\d+", name):
        return f" (did you mean {close[0]!r}?)"
    return ""
