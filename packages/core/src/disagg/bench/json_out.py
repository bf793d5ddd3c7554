"""A command's machine-readable answer alone on stdout (``--json``).

Libraries the answer's computation imports may print there: DeepSpeed logs to stdout when it is
first imported (``Setting accelerator to ...``), and the ``zero`` strategy's estimate imports it,
so ``python -m disagg.bench.published --json | jq`` read a log line before the JSON. The
computation runs with stdout sent to stderr; the JSON is printed after it."""

from __future__ import annotations

import json
import sys
from contextlib import redirect_stdout
from typing import Any, Callable


def print_json(compute: Callable[[], Any], **dumps: Any) -> Any:
    """``compute()`` with its prints (and those of what it imports) on stderr, then its value as
    JSON on stdout (``dumps``: :func:`json.dumps` options); returns the value."""
    with redirect_stdout(sys.stderr):
        value = compute()
    print(json.dumps(value, **dumps))
    return value
