"""Preprocessing in parallel Ray tasks.

Each task preprocesses one record and returns one object per module as
separate Ray return values, so the tensors go straight from the worker into
the object store and the driver owns only the ObjectRefs (a caller-owned
object outlives the worker process; one the worker ``ray.put`` itself would
be lost when Ray recycles that worker). Only a small metadata dict is fetched
by the driver. At most ``num_workers`` tasks run at once; Ray reuses its
worker processes, so imports and the tokenizer are paid once per process.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import ray

from disagg.data.errors import DataError
from disagg.data.preprocess import TooLong, TooLongError, preprocess_record
from disagg.data.records import Record

_TOKENIZERS: dict[tuple[str, str], Any] = {}


def _tokenizer(llm: Any) -> Any:
    key = (type(llm).__qualname__, str(llm.path))
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = llm.tokenizer()
    return _TOKENIZERS[key]


def preprocess_task(
    rec: Record,
    families: dict[str, Any],
    modules: list[str],
    max_tokens: int | None,
    on_too_long: str,
    on_error: str,
) -> tuple[Any, ...]:
    """``(meta, inputs[module] or None for each module)``."""
    import torch

    # several tasks share the cores with the training actors: intra-op threads would only fight
    torch.set_num_threads(1)
    empty = (None,) * len(modules)
    try:
        out = preprocess_record(
            rec, families, _tokenizer(families["llm"]), max_tokens=max_tokens, on_too_long=on_too_long
        )
    except TooLong as exc:
        return ({"status": "dropped", "error": str(exc)}, *empty)
    except TooLongError:
        raise  # data.on_too_long is its own policy; on_error: skip does not cover it
    except DataError as exc:
        if on_error == "skip":
            return ({"status": "skipped", "error": str(exc)}, *empty)
        raise
    meta = {
        "status": "ok",
        "num_tokens": out.num_tokens,
        "num_label_tokens": out.num_label_tokens,
        "num_media_tokens": out.num_media_tokens,
    }
    return (meta, *(out.inputs.get(m) for m in modules))


def run_preprocessing(
    records: Iterable[Record],
    families: dict[str, Any],
    modules: list[str],
    *,
    num_workers: int,
    max_tokens: int | None,
    on_too_long: str,
    on_error: str,
) -> Iterator[tuple[Record, dict[str, Any], list[Any]]]:
    """``(record, meta, module refs)`` in record order; a DataError is re-raised
    as itself (not wrapped in Ray's task error) so its location reaches the user."""
    # num_cpus=0: preprocessing must never wait for CPUs the training groups reserved;
    # the in-flight window below bounds the parallelism instead.
    task = ray.remote(num_cpus=0)(preprocess_task).options(num_returns=1 + len(modules))
    fams = ray.put(families)
    pending: list[tuple[Record, list[Any]]] = []
    in_flight: list[Any] = []
    for rec in records:
        if len(in_flight) >= num_workers:
            _, in_flight = ray.wait(in_flight, num_returns=1)
        refs = task.remote(rec, fams, modules, max_tokens, on_too_long, on_error)
        pending.append((rec, refs))
        in_flight.append(refs[0])
    for rec, refs in pending:
        try:
            meta = ray.get(refs[0])
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, DataError):
                raise type(cause)(cause.location, cause.problem) from None
            raise RuntimeError(f"{rec.source}: preprocessing failed: {exc}") from exc
        yield rec, meta, list(refs[1:])
