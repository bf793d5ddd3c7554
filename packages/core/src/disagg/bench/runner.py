"""Run one layout at one vision length for a few real steps; summarize it.

Every point of a bench uses the same model, data files, precision, seed and steps;
only ``parallel`` (and the microbatch count it implies) differs. One run per
layout covers all its lengths (the actors start once), ``steps`` steps each. Each vision
replica gets one sample per microbatch, so a rank holds one image's
activations at a time: ZeRO-3 a whole image, ``ulysses`` 1/degree of it, which
is what decides the longest image a layout can train.
"""

from __future__ import annotations

import itertools
import json
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from disagg.config.resolved import ResolvedConfig
from disagg.config.schema import Config
from disagg.metrics.step import upgrade
from disagg.plugins import Registry

#: keys of ``parallel`` that are not module groups (kept from the base config)
_PARALLEL_SETTINGS = ("placement", "transport", "collective_timeout_s", "start_timeout_s")


def layout_config(
    base: Config,
    parallel: dict[str, Any],
    *,
    train_jsonl: Path,
    model_dirs: dict[str, str],
    samples: int,
    steps: int,
    precision: str,
    out_dir: Path,
) -> Config:
    """The train config of one layout's run: ``base`` with this layout, data and steps."""
    raw = base.model_dump(mode="json")
    raw["parallel"] = {**{k: v for k, v in raw["parallel"].items() if k in _PARALLEL_SETTINGS}, **parallel}
    for module, path in model_dirs.items():
        raw["model"][module]["path"] = path
    raw["data"] = {
        **(raw.get("data") or {}),
        "train": str(train_jsonl),
        "media_root": str(train_jsonl.parent),
        "eval": None,
        "batch_size": samples,
        "shuffle": False,
        "max_tokens": None,
    }
    vision_replicas = int(parallel.get("vision", {}).get("replicas", 1))
    if samples % vision_replicas:
        raise ValueError(
            f"--samples {samples} is not a multiple of parallel.vision.replicas={vision_replicas}; "
            "every vision replica gets one sample per microbatch"
        )
    raw["train"] = {
        **raw["train"],
        "steps": steps,
        # the recipe decided once for every layout (``auto`` resolved by the bench)
        "precision": precision,
        "microbatches": samples // vision_replicas,
    }
    raw["checkpoint"] = {"every": 0}
    raw["output_dir"] = str(out_dir)
    return Config.model_validate(raw)


class ChainedSource:
    """``steps`` batches of each length's data source in turn: one run (one
    start of the actors) covers every length of a layout."""

    def __init__(self, parts: list[Any], steps: int) -> None:
        self.parts, self.steps = parts, steps

    def batches(self, start_step: int = 0) -> Iterator[list[Any]]:
        for src in self.parts:
            yield from itertools.islice(src.batches(0), self.steps)

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for src in self.parts:
            for k, v in src.stats().items():
                out[k] = out.get(k, 0) + int(v)
        return out


def run_layout(
    resolved: ResolvedConfig, registry: Registry, jsonls: list[Path], steps: int
) -> tuple[list[list[dict[str, Any]]], str | None]:
    """Train the validated config ``resolved`` over each dataset in ``jsonls`` for
    ``steps`` steps each; return the metric records of each, and the error that
    stopped the run (if one did: the lengths it reached keep their records)."""
    import ray

    from disagg.config.resolved import require_resolved, reserved_cpus
    from disagg.data import build_data_source
    from disagg.runtime.plan import make_plan
    from disagg.runtime.run import ensure_ray, run_training

    resolved = require_resolved(resolved, "run_layout")
    cfg = resolved.config
    ensure_ray(cfg.ray.address, cfg.ray.num_cpus, reserved=reserved_cpus(resolved))
    families = make_plan(resolved, registry, ray.cluster_resources().get("GPU", 0.0)).families
    parts = []
    for path in jsonls:
        one = cfg.model_copy(deep=True)
        one.data.train, one.data.media_root = str(path), str(path.parent)  # type: ignore[union-attr]
        parts.append(build_data_source(one, families))
    error = None
    try:
        run_training(resolved, registry=registry, data_source=ChainedSource(parts, steps), progress=False)
    except Exception as exc:  # an out-of-memory length is a result: keep what ran before it
        error = f"{type(exc).__name__}: {exc}"
    run_dir = Path(cfg.output_dir)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # a bench keeps figures, not weights
    metrics = run_dir / "metrics.jsonl"
    records = (
        [upgrade(json.loads(x)) for x in metrics.read_text().splitlines() if x.strip()]
        if metrics.exists()
        else []
    )
    return [records[k * steps : (k + 1) * steps] for k in range(len(jsonls))], error


def summarize(records: list[dict[str, Any]], warmup: int = 1) -> dict[str, Any]:
    """Medians over the steps after ``warmup`` (all steps when there are no more);
    byte counts from the last step (they repeat exactly from step to step)."""
    timed = records[warmup:] or records
    last = timed[-1]
    modules = sorted(last["comm_bytes_per_rank"])

    def median(key: str, m: str | None = None) -> float:
        return statistics.median(r[key][m] if m else r[key] for r in timed)

    groups = {}
    for m in modules:
        groups[m] = {
            "busy_s": median("busy_s", m),
            "wait_s": median("wait_s", m) if "wait_s" in last else None,
            "comm_bytes_per_rank": last["comm_bytes_per_rank"][m],
            "collective_bytes_per_rank": (last.get("collective_bytes_per_rank") or {}).get(m),
            "collective_calls_per_rank": (last.get("collective_calls_per_rank") or {}).get(m),
            "sent_bytes_per_rank": (last.get("sent_bytes_per_rank") or {}).get(m),
            "state_bytes_per_rank": last["state_bytes_per_rank"][m],
            "activation_bytes_per_rank": max(r["activation_bytes_per_rank"][m] for r in records),
            "peak_mem_bytes": max(r["peak_mem_bytes"][m] for r in records),
            # the driver's count over the step's real samples (absent where the family has no shape)
            "flops": median("flops", m) if m in (last.get("flops") or {}) else None,
        }
    return {
        "steps": len(records),
        "timed_steps": len(timed),
        "tokens_per_step": last["tokens"],
        "step_time_s": median("step_time_s"),
        "tokens_per_s": median("tokens_per_s"),
        "final_loss": last["loss"],
        "groups": groups,
    }


def memory_per_rank(groups: dict[str, dict[str, Any]], placement: str, key: str = "measured") -> int:
    """Saved activations + state per device, the machine-independent memory figure:
    groups collocated on the same devices add up, disaggregated ones do not."""
    figures = [g["state_bytes_per_rank"] + g["activation_bytes_per_rank"] for g in groups.values()]
    return sum(figures) if placement == "collocated" else max(figures)


class Progress:
    """One line per finished point, with an estimate of what is left."""

    def __init__(self, total: int, echo: Callable[[str], None] = print) -> None:
        self.total, self.done, self.t0, self.echo = total, 0, time.perf_counter(), echo

    def start(self, what: str) -> None:
        self.echo(f"[{self.done + 1}/{self.total}] {what} ...")

    def finish(self, what: str) -> None:
        self.done += 1
        spent = time.perf_counter() - self.t0
        left = spent / self.done * max(self.total - self.done, 0)
        self.echo(f"[{self.done}/{self.total}] {what} ({spent:.0f} s so far, ~{left:.0f} s left)")
