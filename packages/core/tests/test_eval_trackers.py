"""Evaluation during training and experiment trackers, through ``run_training``
with the toy families (ddp, two vision replicas feeding one LLM replica).

One 3-step run serves every check: the train batch is the same every step and
the eval set is that batch, so the eval loss after step k (weights updated by
k steps) is the train loss of step k+1 (measured on the same weights before
update k+1). The toy models have no dropout, so eval mode changes nothing else.
The run also writes TensorBoard, MLflow and W&B (offline), and a third-party
tracker registered here records what it receives.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from disagg import hookimpl
from disagg.config.schema import Config
from disagg.config.validate import validate
from disagg.interfaces import Tracker
from disagg.testing import toy
from disagg.testing.toy import make_toy_dirs, put_samples, toy_samples


def plugins_trackers() -> dict[str, type]:
    from disagg import plugins

    pm, _ = plugins.make_plugin_manager(load_entry_points=False)
    return plugins.build_registry(pm).trackers


#: the first-party trackers whose libraries are here (all of them in the nox tests session)
INSTALLED = [n for n, cls in plugins_trackers().items() if n != "jsonl" and not cls.missing()]
STEPS = 3
BATCH = 5  # two vision replicas, two microbatches: the replicas get uneven shares


def _needs(name: str) -> None:
    if name not in INSTALLED:
        pytest.skip(f"tracker {name!r} is not installed (pip install 'disagg-core[trackers]')")


class SameBatch:
    """The same global batch at every step (a ``DataSource``)."""

    def __init__(self, samples: list) -> None:
        self.samples = samples

    def batches(self, start_step: int = 0):
        while True:
            yield put_samples(self.samples)

    def stats(self) -> dict[str, int]:
        return {"skipped": 0, "dropped_too_long": 0}


class EvalSet:
    def __init__(self, samples: list) -> None:
        self._samples = samples

    def samples(self) -> list:
        return put_samples(self._samples, start=100)


class Recorder(Tracker):
    """A third party's tracker: remembers every hook call it gets."""

    name = "recorder"
    calls: list[tuple[str, Any]] = []

    @hookimpl
    def disagg_run_started(self, config: dict[str, Any], run_dir: Path) -> None:
        Recorder.calls.append(("started", {"config": config, "run_dir": run_dir, "project": self.project}))

    @hookimpl
    def disagg_log_metrics(self, step: int, metrics: dict[str, Any], scalars: dict[str, float]) -> None:
        Recorder.calls.append(("step", {"step": step, "metrics": metrics, "scalars": scalars}))

    @hookimpl
    def disagg_run_finished(self, summary: dict[str, Any]) -> None:
        Recorder.calls.append(("finished", summary))


class RecorderPlugin:
    @hookimpl
    def disagg_register_trackers(self, register):
        register(Recorder)


@pytest.fixture(scope="module")
def run(ray_local, tmp_path_factory):
    from disagg import plugins
    from disagg.runtime.run import run_training

    tmp = tmp_path_factory.mktemp("evalrun")
    enc, lm = make_toy_dirs(tmp / "models")
    previous = plugins._REGISTRY  # noqa: SLF001 - restored below, as the disagg_registry fixture does
    pm, _ = plugins.make_plugin_manager(load_entry_points=False)
    plugins.set_registry(plugins.build_registry(pm))
    plugins.register_plugin(toy, name="disagg.testing.toy")
    registry = plugins.register_plugin(RecorderPlugin(), name="recorder-plugin")
    Recorder.calls.clear()
    cfg = Config.model_validate(
        {
            "model": {
                "vision": {"family": "toy", "path": str(enc)},
                "llm": {"family": "toy", "path": str(lm)},
            },
            "parallel": {"vision": {"replicas": 2}, "llm": {"replicas": 1}},
            "train": {"steps": STEPS, "lr": 1e-2, "microbatches": 2, "eval_every": 1},
            "checkpoint": {"every": 1, "keep_last": 1, "keep_best": "eval_loss"},
            "logging": {"trackers": [*INSTALLED, "recorder"], "project": "evaltest"},
            "output_dir": str(tmp / "run"),
        }
    )
    batch = toy_samples(BATCH, seed=3, text_only_every=3)
    try:
        summary = run_training(
            validate(cfg, registry),
            registry=registry,
            data_source=SameBatch(batch),
            eval_source=EvalSet(batch),
            progress=False,
        )
    finally:
        plugins.set_registry(previous)
    rows = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"summary": summary, "rows": rows, "run_dir": tmp / "run", "calls": list(Recorder.calls)}


def test_eval_loss_after_step_k_is_train_loss_of_step_k_plus_1(run):
    rows = run["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("eval_loss" in r for r in rows)  # eval_every: 1, and the last step
    for k in range(STEPS - 1):
        assert rows[k]["eval_loss"] == pytest.approx(rows[k + 1]["loss"], rel=1e-6, abs=0)
    # the same normalisation: every label token of the set, once
    assert all(r["eval_label_tokens"] == r["label_tokens"] and r["eval_samples"] == BATCH for r in rows)
    assert rows[-1]["eval_loss"] < rows[0]["loss"]  # training did something the eval sees
    assert run["summary"]["eval_loss"] == rows[-1]["eval_loss"]


def test_evaluation_counts_toward_no_training_step(run):
    """Same batch, same routing: a step after an evaluation communicates what
    the first did; evaluation's own collectives and shards are not added."""
    rows = run["rows"]
    for r in rows[1:]:
        assert r["comm_bytes"] == rows[0]["comm_bytes"]
        assert r["collective_calls_per_rank"] == rows[0]["collective_calls_per_rank"]
    assert rows[0]["module_tokens"]["llm"] == rows[0]["tokens"] == rows[0]["eval_module_tokens"]["llm"]


def test_keep_best_keeps_the_lowest_eval_loss_beside_the_newest(run):
    rows, ckpts = run["rows"], run["run_dir"] / "checkpoints"
    best = min(rows, key=lambda r: r["eval_loss"])
    pointer = json.loads((ckpts / "best.json").read_text())
    assert pointer["step"] == best["step"] and pointer["eval_loss"] == best["eval_loss"]
    kept = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step-"))
    assert kept == sorted({f"step-{best['step']}", f"step-{STEPS}"})  # keep_last: 1, plus the best
    assert run["summary"]["best_checkpoint"] == pointer["checkpoint"]


def test_tensorboard_events_hold_the_logged_losses(run):
    _needs("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run["run_dir"] / "tensorboard"))
    acc.Reload()
    for tag, key in (("train/loss", "loss"), ("eval/loss", "eval_loss"), ("train/grad_norm", "grad_norm")):
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        # TensorBoard stores scalars as float32
        assert got == [(r["step"], float(np.float32(r[key]))) for r in run["rows"]], tag
    assert "vision/comm_bytes_per_rank" in acc.Tags()["scalars"]


def test_mlflow_run_holds_the_logged_losses(run):
    _needs("mlflow")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run['run_dir'].resolve() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("evaltest")
    (mlrun,) = client.search_runs([experiment.experiment_id])
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "run"
    for name, key in (("train/loss", "loss"), ("eval/loss", "eval_loss")):
        history = sorted((m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, name))
        assert history == [(r["step"], r[key]) for r in run["rows"]], name
    assert mlrun.data.params["train.lr"] == "0.01" and mlrun.data.params["train.eval_every"] == "1"


def test_wandb_offline_run_is_written(run):
    _needs("wandb")
    runs = list((run["run_dir"] / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (data,) = runs[0].glob("run-*.wandb")
    assert data.stat().st_size > 0


def test_third_party_tracker_gets_the_run_dir_and_every_step(run):
    calls = run["calls"]
    kinds = [k for k, _ in calls]
    assert kinds == ["started", "step", "step", "step", "finished"]
    started = calls[0][1]
    assert Path(started["run_dir"]) == run["run_dir"] and started["project"] == "evaltest"
    assert started["config"]["train"]["eval_every"] == 1  # the resolved config, as data
    steps = [c for k, c in calls if k == "step"]
    assert [c["step"] for c in steps] == [1, 2, 3]
    for c, row in zip(steps, run["rows"]):
        assert c["metrics"] == row  # what metrics.jsonl holds
        assert c["scalars"]["train/loss"] == row["loss"] and c["scalars"]["eval/loss"] == row["eval_loss"]
        assert c["scalars"]["vision/comm_bytes_per_rank"] == row["comm_bytes_per_rank"]["vision"]
        assert c["scalars"]["llm/tokens"] == row["module_tokens"]["llm"]
    assert calls[-1][1]["status"] == "ok" and calls[-1][1]["run_dir"] == str(run["run_dir"])


def test_plot_draws_the_run(run, tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from disagg.cli.main import main
    from disagg.metrics.plot import read_metrics

    assert main(["plot", str(run["run_dir"])]) == 0
    for name in ("loss.png", "throughput.png", "memory.png"):
        with Image.open(run["run_dir"] / "plots" / name) as im:
            assert im.format == "PNG" and im.size[0] > 100
    assert [r["step"] for r in read_metrics(run["run_dir"] / "metrics.jsonl")] == [1, 2, 3]
    assert main(["plot", str(tmp_path)]) == 2  # no metrics.jsonl: a usage error naming RUN_DIR
