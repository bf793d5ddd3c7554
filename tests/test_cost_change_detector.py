"""CHANGE DETECTOR, not a verification: the cost model's predictions equal the ones recorded
in ``data/cost_predictions.json.gz``.

The file was written from the code's own output (``python tests/cost_fixture.py``) and has been
re-recorded whenever a cost rule changed on purpose (12 of its 13 commits so far). Equality with
it proves nothing about whether a prediction is right, only that it did not move: the first-party
strategies' ``estimate`` on a grid of queries, ``disagg bench --predict``'s rows and ``disagg
plan``'s whole ranking, on the published Qwen2.5-VL-32B and the tiny Qwen2.5-VL, with and without
the efficiency curve. A failure means a prediction changed: if the change is intended, re-record
the file and say in the commit which rule changed and why; if not, find what moved it. What the
predictions are checked against (measured bytes, calls, FLOPs, saved activations) lives in the
verifying tests (``test_flops_measured.py``, ``test_lora_bytes.py``, ``test_cost_tp_sp.py`` ...).
The invariant that the efficiency curve moves only time is ``test_cost_time_only_moves.py``."""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_zero")

from cost_fixture import recorded_and_current  # noqa: E402

#: floats agree to this relative error: Python 3.12's ``sum`` of floats is compensated (3.11's
#: is not), which moves a prediction's last bit; a cost rule that changes moves far more
REL = 1e-12


def same(now: Any, then: Any) -> bool:
    """Equal, but for floats within ``REL`` of each other (in any nesting of dicts and lists)."""
    if isinstance(now, float) or isinstance(then, float):
        return (
            isinstance(now, (int, float))
            and isinstance(then, (int, float))
            and math.isclose(now, then, rel_tol=REL)
        )
    if isinstance(now, dict) and isinstance(then, dict):
        return now.keys() == then.keys() and all(same(now[k], then[k]) for k in now)
    if isinstance(now, (list, tuple)) and isinstance(then, (list, tuple)):
        return len(now) == len(then) and all(same(a, b) for a, b in zip(now, then))
    return now == then


def test_predictions_unchanged_since_recorded():
    recorded, now = recorded_and_current()
    for e_now, e_then in zip(now["estimates"], recorded["estimates"], strict=True):
        assert same(e_now, e_then), f"estimate {e_then['key']} changed since recorded"
    assert same(now["bench_predict"], recorded["bench_predict"])
    for name, then in recorded["plans"].items():
        for x_now, x_then in zip(now["plans"][name]["ranking"], then["ranking"], strict=True):
            assert same(x_now, x_then), f"plan {name} changed since recorded: {x_now} != {x_then}"
        assert same(now["plans"][name], then)
    shaped, then = now["by_shape"], recorded["by_shape"]
    for i, (c_now, c_then) in enumerate(zip(shaped["compute_s"], then["compute_s"], strict=True)):
        assert same(c_now, c_then), f"compute seconds of estimate {now['estimates'][i]['key']} changed"
    assert same(shaped, then)


def test_same_tells_a_moved_prediction_from_a_last_bit() -> None:
    assert same({"a": [3.7574457754060187, 1]}, {"a": [3.757445775406019, 1]})
    assert not same({"a": [3.7574457754060187, 1]}, {"a": [3.7574457754, 1]})
    assert not same({"a": [1.0, 1]}, {"a": [1.0, 2]}) and not same({"a": 1.0}, {"b": 1.0})
