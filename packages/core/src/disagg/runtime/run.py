"""``disagg train``: the training loop, read as a short story."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import ray

from disagg.config.dump import dump_resolved
from disagg.config.resolved import ResolvedConfig, require_resolved, reserved_cpus
from disagg.config.schema import Config
from disagg.data.balance import balance
from disagg.metrics.flops import FlopCounting, flop_counting
from disagg.metrics.scalars import scalars
from disagg.metrics.step import step_record, summarize
from disagg.plugins import Registry, get_registry, notify
from disagg.runtime.checkpoint import load_checkpoint, save_checkpoint
from disagg.runtime.evaluation import Evaluation, eval_samples
from disagg.runtime.failures import ActorDied
from disagg.runtime.feature_cache import feature_caches
from disagg.runtime.lookahead import Lookahead
from disagg.runtime.orchestrator import Orchestrator
from disagg.runtime.plan import make_plan
from disagg.runtime.recovery import recover
from disagg.runtime.routing import contiguous
from disagg.runtime.tracking import start_trackers, stop_trackers


def run_training(
    resolved: ResolvedConfig,
    *,
    address: str | None = None,
    registry: Registry | None = None,
    data_source: Any = None,
    eval_source: Any = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train as ``cfg`` says; return the final summary (with ``run_dir``).

    ``resolved`` is what :func:`disagg.config.validate.validate` returned (plugins
    resolved once, nothing re-checked here). ``data_source`` / ``eval_source`` (anything with
    ``samples()``) replace ``data.train`` / ``data.eval`` (tests, notebooks).
    """
    registry = registry or get_registry()
    resolved = require_resolved(resolved, "run_training")
    cfg = resolved.config
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_resolved(cfg, run_dir)
    pm = registry.pm
    # before any actor starts: a tracker also records a run that fails to start
    trackers = start_trackers(cfg, run_dir, registry)
    logger = trackers[0]  # the always-on jsonl tracker: restarts are recorded in metrics.jsonl
    records: list[dict[str, Any]] = []
    status = "failed"
    orch: Orchestrator | None = None
    evaluation: Evaluation | None = None
    resume = cfg.checkpoint.resume_from
    failures = 0
    try:
        ensure_ray(address or cfg.ray.address, cfg.ray.num_cpus, reserved=reserved_cpus(resolved))
        total = ray.cluster_resources()
        plan = make_plan(resolved, registry, total.get("GPU", 0.0), total.get("CPU"))
        counting = flop_counting(cfg, registry, plan.device, plan.precision)
        if data_source is None:
            from disagg.data import build_data_source

            data_source = build_data_source(cfg, plan.families)
        evaluation = Evaluation(cfg, run_dir, eval_samples(cfg, plan.families, eval_source))
        while True:
            orch = _start_groups(cfg, plan, registry)
            try:
                _train(orch, cfg, run_dir, data_source, evaluation, resume, records, pm, progress, counting)
                break
            except ActorDied as exc:
                # a rank's process or node is gone: new groups resume from the newest checkpoint
                failures += 1
                orch.shutdown()
                orch = None
                resume = recover(exc, failures, cfg, run_dir, logger) or cfg.checkpoint.resume_from
        status = "ok"
    finally:
        summary = summarize(records, str(run_dir), status)
        if records:
            summary["checkpoint"] = str(run_dir / "checkpoints" / f"step-{records[-1]['step']}")
        if evaluation is not None and evaluation.best is not None:
            summary["best_checkpoint"] = evaluation.best["checkpoint"]
        summary["restarts"] = failures if status == "ok" else max(failures - 1, 0)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        try:
            notify("disagg_run_finished", pm=pm, summary=summary)
        finally:
            stop_trackers(trackers, pm)
            if orch is not None:
                orch.shutdown()
    return summary


def _start_groups(cfg: Config, plan: Any, registry: Registry) -> Orchestrator:
    return Orchestrator(
        plan.specs,
        placement=cfg.parallel.placement,
        device=plan.device,
        precision=plan.precision,
        seed=cfg.train.seed,
        microbatches=cfg.train.microbatches,
        clip_grad_norm=cfg.train.clip_grad_norm,
        transport=plan.transport,
        collective_timeout_s=cfg.parallel.collective_timeout_s,
        start_timeout_s=cfg.parallel.start_timeout_s,
        placement_timeout_s=min(cfg.parallel.start_timeout_s, EMBEDDED_PLACEMENT_S) if _EMBEDDED else None,
        schedule=registry.schedules[cfg.train.schedule](),
        max_inflight=cfg.train.max_inflight,
        assign=balance if cfg.parallel.assign == "balanced" else contiguous,
        caches=feature_caches(cfg, plan.precision),
    )


def _train(
    orch: Orchestrator,
    cfg: Config,
    run_dir: Path,
    data_source: Any,
    evaluation: Evaluation,
    resume: str | Path | None,
    records: list[dict[str, Any]],
    pm: Any,
    progress: bool,
    counting: FlopCounting | None = None,
) -> None:
    """Steps from ``resume`` (or the start) to ``train.steps``, appending to
    ``records`` (steps after ``resume`` from an earlier attempt are dropped)."""
    start, state = load_checkpoint(orch, cfg, resume) if resume else (0, None)
    records[:] = [r for r in records if r["step"] <= start]
    # the stream continues where the checkpointed run stopped (skips included)
    batches = data_source.batches(start, state=state) if state is not None else data_source.batches(start)
    bar = _progress(cfg.train.steps, start, progress)
    shown: dict[str, str] = {}
    ahead = max((c.ahead for c in orch.caches.values()), default=0)
    if ahead:  # a cached frozen encoder works on the next batches meanwhile (lookahead.py)
        batches = data_source = Lookahead(data_source, batches, ahead, cfg.train.steps - start)
    try:
        for step, read in zip(range(start + 1, cfg.train.steps + 1), batches):
            batch, upcoming = read if ahead else (read, [])
            result = orch.step(batch, upcoming)
            flops, peak = counting.step(batch) if counting is not None else ({}, None)
            record = step_record(step, result, data_source.stats(), flops, peak)
            if evaluation.due(step):  # after the step: the eval loss of the updated weights
                record.update(evaluation.run(orch))
            records.append(record)
            notify("disagg_log_metrics", pm=pm, step=step, metrics=record, scalars=scalars(record))
            if "eval_loss" in record:  # shown until the next evaluation
                shown["eval_loss"] = f"{record['eval_loss']:.4f}"
            bar.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", **shown)
            bar.update(1)
            best = "eval_loss" in record and evaluation.improves(record["eval_loss"])
            scheduled = cfg.checkpoint.every and step % cfg.checkpoint.every == 0
            if (scheduled or best) and step != cfg.train.steps:
                _save(orch, cfg, run_dir, step, data_source, evaluation, record if best else None)
    finally:
        bar.close()
        if hasattr(batches, "close"):  # an abandoned stream stops prefetching
            batches.close()
    last = records[-1]["step"] if records else start
    if records and last < cfg.train.steps:
        raise RuntimeError(f"the data ran out after step {last} of train.steps={cfg.train.steps}")
    final = records[-1] if records else {}
    best = "eval_loss" in final and evaluation.improves(final["eval_loss"])
    _save(orch, cfg, run_dir, last, data_source, evaluation, final if best else None)


def _save(
    orch: Orchestrator,
    cfg: Config,
    run_dir: Path,
    step: int,
    data_source: Any,
    evaluation: Evaluation,
    best: dict[str, Any] | None = None,
) -> None:
    """Checkpoint ``step``; ``best``: its record, whose eval loss is the lowest
    so far (``checkpoint.keep_best``). ``keep_last`` never removes the best."""
    state = data_source.state() if hasattr(data_source, "state") else None
    path = Path(run_dir) / "checkpoints" / f"step-{step}"
    keep = path if best is not None else evaluation.best_path()
    save_checkpoint(orch, cfg, run_dir, step, state, keep=keep)
    if best is not None:
        evaluation.mark_best(step, best["eval_loss"], path)


#: logical CPUs a local Ray keeps free of training actors, for Ray Data's tasks
SPARE_CPUS = 2
#: how long groups wait to be placed on an embedded Ray: its resources never grow (no
#: autoscaler, no other node joins), so a placement not met at once will never be
EMBEDDED_PLACEMENT_S = 30.0
#: this process started its own Ray (:func:`ensure_ray` without an address)
_EMBEDDED = False


def ensure_ray(address: str | None, num_cpus: int | None, reserved: float = 0) -> None:
    """Join ``address`` or start an embedded local Ray (once per process);
    ``reserved``: the logical CPUs the training ranks will hold
    (:func:`disagg.config.resolved.reserved_cpus`)."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
        return
    # More logical CPUs than cores, so that every group's actors fit on a laptop,
    # and two to spare: with every logical CPU held by a training actor, Ray
    # Data's streaming executor launched no preprocessing task and a run of
    # 8 actors on 8 logical CPUs (bench at degree 4) never reached step 1.
    global _EMBEDDED
    spare = math.ceil(reserved) + SPARE_CPUS
    _EMBEDDED = True
    ray.init(num_cpus=num_cpus or max(8, os.cpu_count() or 1, spare), include_dashboard=False)


def _progress(total: int, start: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", disable=not enabled)
