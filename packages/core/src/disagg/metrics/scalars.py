"""A ``metrics.jsonl`` record flattened to tracker names.

Run-wide figures go under ``train/`` (``train/loss``, ``train/tokens_per_s``),
evaluation under ``eval/`` (``eval/loss``, ``eval/vision/tokens``), per-module
figures under the module (``vision/comm_bytes_per_rank``), and figures by
collective kind one level deeper (``llm/collective_bytes_per_rank/all_reduce``).
Only numbers are kept; ``step`` is the trackers' own axis.
"""

from __future__ import annotations

from typing import Any

#: record keys whose tracker name differs from the key
RENAMES = {"module_tokens": "tokens"}


def scalars(record: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step":
            continue
        scope, name = ("eval", key[len("eval_") :]) if key.startswith("eval_") else ("train", key)
        name = RENAMES.get(name, name)
        if isinstance(value, dict):  # per module
            for module, v in value.items():
                base = f"{module}/{name}" if scope == "train" else f"eval/{module}/{name}"
                if isinstance(v, dict):  # by collective kind
                    out.update({f"{base}/{kind}": float(x) for kind, x in v.items() if _number(x)})
                elif _number(v):
                    out[base] = float(v)
        elif _number(value):
            out[f"{scope}/{name}"] = float(value)
    return out


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
