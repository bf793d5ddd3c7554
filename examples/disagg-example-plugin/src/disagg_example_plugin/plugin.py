"""What a third-party disagg plugin looks like.

Declared in ``pyproject.toml`` as an entry point of group ``disagg``::

    [project.entry-points.disagg]
    example = "disagg_example_plugin.plugin"

It implements two hooks of :mod:`disagg.hookspecs`:

- ``disagg_log_metrics``: appends each step's metrics to the CSV file named by
  ``DISAGG_EXAMPLE_CSV`` (does nothing when it is unset);
- ``disagg_register_strategies``: registers ``example_ddp``, plain data
  parallelism with one option, to show how a strategy declares and validates
  its extra ``parallel.<module>`` keys, and states its own cost
  (:mod:`disagg_example_plugin.cost`) so that ``disagg plan`` ranks it.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any, Callable, ClassVar

from pydantic import Field
from torch import nn

import disagg
from disagg.interfaces import Cost, CostQuery, StrategyOptions
from disagg.kit import Strategy

CSV_ENV = "DISAGG_EXAMPLE_CSV"


class ExampleOptions(StrategyOptions):
    log_every: int = Field(1, ge=1)
    """An option users write as ``parallel.<module>.log_every``."""


class ExampleDDP(Strategy):
    """Data parallelism under another name, with an options model: the base
    ``Strategy`` already keeps a whole replica per rank, sums gradients over
    the group, steps AdamW, holds the full form, and its default ``check``
    refuses a degree above ``max_degree``, so a plugin built only on
    ``disagg.interfaces`` (the contracts) and ``disagg.kit`` (the building blocks)
    implements nothing more than ``parallelize``."""

    name: ClassVar[str] = "example_ddp"
    distribution: ClassVar[str] = "disagg-example-plugin"
    options_model: ClassVar[type[StrategyOptions]] = ExampleOptions
    max_degree: ClassVar[int | None] = 1  # no sharding: the default check refuses degree > 1

    def parallelize(self, module: nn.Module) -> nn.Module:
        return module

    @classmethod
    def estimate(cls, query: CostQuery, options: StrategyOptions) -> Cost | None:
        from disagg_example_plugin import cost

        return cost.estimate(query)


@disagg.hookimpl
def disagg_register_strategies(register: Callable[[type], None]) -> None:
    register(ExampleDDP)


@disagg.hookimpl
def disagg_log_metrics(step: int, metrics: dict[str, Any]) -> None:
    path = os.environ.get(CSV_ENV)
    if not path:
        return
    # Only scalar fields: per-group dicts (peak memory, comm bytes) stay in metrics.jsonl.
    row = {"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}}
    file = Path(path)
    # The first step fixes the columns; later steps fill those they have.
    header = next(csv.reader(file.open()), None) if file.exists() else None
    with file.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header or list(row), extrasaction="ignore")
        if header is None:
            writer.writeheader()
        writer.writerow(row)
