"""Evaluation during training: when (``train.eval_every`` and the last step),
on what (every sample of ``data.eval``, preprocessed once and kept in the
object store), and the best eval loss so far (``checkpoint.keep_best``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disagg.config.schema import Config
from disagg.data.types import SampleRefs
from disagg.metrics.step import eval_fields

BEST = "best.json"


class Evaluation:
    def __init__(self, cfg: Config, run_dir: Path, samples: list[SampleRefs] | None) -> None:
        self.samples = samples
        self.every = cfg.train.eval_every
        self.last = cfg.train.steps
        # a training microbatch's size: evaluation needs no more activation memory than a step
        self.chunk = max(1, cfg.data.batch_size // cfg.train.microbatches) if cfg.data else None
        self.keep_best = cfg.checkpoint.keep_best is not None
        self.best_file = Path(run_dir) / "checkpoints" / BEST
        self.best: dict[str, Any] | None = None
        if self.keep_best and self.best_file.is_file():  # a resumed run continues its record
            self.best = json.loads(self.best_file.read_text())

    def due(self, step: int) -> bool:
        return bool(self.samples) and (step == self.last or bool(self.every and step % self.every == 0))

    def run(self, orch: Any) -> dict[str, Any]:
        """The ``eval_*`` fields of this step's record."""
        assert self.samples
        return eval_fields(orch.evaluate(self.samples, self.chunk))

    def improves(self, eval_loss: float) -> bool:
        """Whether ``checkpoint.keep_best`` should keep a checkpoint of this step."""
        return self.keep_best and (self.best is None or eval_loss < self.best["eval_loss"])

    def best_path(self) -> Path | None:
        return Path(self.best["checkpoint"]) if self.best else None

    def mark_best(self, step: int, eval_loss: float, checkpoint: Path) -> None:
        self.best = {"step": step, "eval_loss": eval_loss, "checkpoint": str(checkpoint)}
        tmp = self.best_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.best, indent=2))
        tmp.rename(self.best_file)  # atomic: never a half-written pointer


def eval_samples(cfg: Config, families: dict[str, Any], eval_source: Any = None) -> list[SampleRefs] | None:
    """Every usable sample of ``eval_source`` (anything with ``samples()``) or
    of ``data.eval``; ``None`` when the run has no eval set."""
    if eval_source is None:
        if cfg.data is None or not cfg.data.eval:
            return None
        from disagg.data import build_data_source

        eval_source = build_data_source(cfg, families, split="eval")
    return list(eval_source.samples())
