"""Preprocessing in parallel Ray workers.

Each worker loads the LLM tokenizer once and preprocesses records. Its method
returns one object per module as separate Ray return values, so the tensors go
straight from the worker into the object store and the driver owns only the
ObjectRefs (owning them keeps them alive after the worker exits; objects a
worker ``ray.put`` itself would die with it). Only a small metadata dict is
fetched by the driver.
"""

from __future__ import annotations

from typing import Any

import ray

from disagg.data.errors import DataError
from disagg.data.preprocess import TooLong, TooLongError, preprocess_record
from disagg.data.records import Record


class Preprocessor:
    def __init__(self, families: dict[str, Any], modules: list[str], max_tokens: int | None,
                 on_too_long: str, on_error: str) -> None:
        import torch

        # many small workers on shared cores: intra-op threads would only fight
        torch.set_num_threads(1)
        self.families = families
        self.modules = modules
        self.tokenizer = families["llm"].tokenizer()
        self.max_tokens, self.on_too_long, self.on_error = max_tokens, on_too_long, on_error

    def run(self, rec: Record) -> tuple[Any, ...]:
        """``(meta, inputs[module] or None for each module)``."""
        empty = (None,) * len(self.modules)
        try:
            out = preprocess_record(
                rec, self.families, self.tokenizer, max_tokens=self.max_tokens, on_too_long=self.on_too_long
            )
        except TooLong as exc:
            return ({"status": "dropped", "error": str(exc)}, *empty)
        except TooLongError:
            raise
        except DataError as exc:
            if self.on_error == "skip":
                return ({"status": "skipped", "error": str(exc)}, *empty)
            raise
        meta = {
            "status": "ok",
            "num_tokens": out.num_tokens,
            "num_label_tokens": out.num_label_tokens,
            "num_media_tokens": out.num_media_tokens,
        }
        return (meta, *(out.inputs.get(m) for m in self.modules))


def start_workers(n: int, families: dict[str, Any], modules: list[str], max_tokens: int | None,
                  on_too_long: str, on_error: str) -> list[Any]:
    # num_cpus=0: transient helpers must never wait for CPUs the training groups reserved
    cls = ray.remote(num_cpus=0)(Preprocessor)
    return [cls.remote(families, modules, max_tokens, on_too_long, on_error) for _ in range(n)]


def unwrap(exc: BaseException) -> BaseException:
    """The DataError inside a RayTaskError, or the exception itself."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, DataError):
        return type(cause)(cause.location, cause.problem)
    return exc
