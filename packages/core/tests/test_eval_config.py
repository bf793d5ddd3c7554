"""Validation of the evaluation, epochs and tracker keys (no actor), and
``checkpoint.keep_best`` against a fake orchestrator."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from disagg import hookimpl
from disagg.config import ConfigError, load_config_and_source
from disagg.config.schema import Config
from disagg.config.validate import validate
from disagg.interfaces import Tracker
from disagg.plugins import get_registry, register_plugin

sys.path.insert(0, str(Path(__file__).parent))
import disagg_cfgtest_plugin  # noqa: E402


class NeedsLib(Tracker):
    name = "needslib"
    requires = ("disagg_no_such_module_xyz",)
    install = "pip install disagg-no-such-lib"


class Plugin:
    @hookimpl
    def disagg_register_trackers(self, register):
        register(NeedsLib)


@pytest.fixture
def reg(disagg_registry):
    register_plugin(disagg_cfgtest_plugin, name="cfgtest")
    return register_plugin(Plugin(), name="needslib-plugin")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    for d in ("enc", "llm", "media"):
        (tmp_path / d).mkdir()
    row = json.dumps({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]})
    (tmp_path / "d.jsonl").write_text(f"{row}\n" * 10)
    (tmp_path / "e.jsonl").write_text(f"{row}\n" * 3)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def base(**over) -> dict:
    cfg = {
        "model": {
            "vision": {"family": "cfgtest", "path": "enc"},
            "llm": {"family": "cfgtest", "path": "llm"},
        },
        "parallel": {"vision": {"strategy": "cfgtest_sp", "degree": 2}, "llm": {"replicas": 2}},
        "data": {"train": "d.jsonl", "media_root": "media", "batch_size": 4},
        "train": {"microbatches": 2},
    }
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return cfg


def check(workdir: Path, cfg: dict):
    p = workdir / "c.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    loaded, source = load_config_and_source(p, [])
    return validate(loaded, get_registry(), source=source)


def problems(workdir: Path, cfg: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        check(workdir, cfg)
    return {p.key: f"{p.where}: {p.message}" for p in info.value.problems}


def test_epochs_derive_the_steps(reg, workdir):
    # 10 samples, batch 4: 2.5 steps per epoch; 3 epochs -> ceil(7.5) = 8 steps
    resolved = check(workdir, base(train={"epochs": 3}))
    assert resolved.config.train.steps == 8 and resolved.config.train.epochs is None
    assert check(workdir, base(train={"epochs": 0.5})).config.train.steps == 2  # ceil(1.25)
    assert check(workdir, base(train={"steps": 7})).config.train.steps == 7


def test_steps_and_epochs_together_are_refused(reg, workdir):
    got = problems(workdir, base(train={"epochs": 2, "steps": 5}))
    assert "exactly one" in got["train.epochs"] and "c.yaml" in got["train.epochs"]
    (workdir / "d.jsonl").write_text('{"rows": 1}\n')  # an unknown row format: named, not a crash
    assert "cannot count the samples" in problems(workdir, base(train={"epochs": 1}))["train.epochs"]


def test_eval_every_and_keep_best_need_an_eval_set(reg, workdir):
    got = problems(workdir, base(train={"eval_every": 2}, checkpoint={"keep_best": "eval_loss"}))
    assert "needs data.eval" in got["train.eval_every"] and "needs data.eval" in got["checkpoint.keep_best"]
    ok = check(workdir, base(train={"eval_every": 2}, data={"eval": "e.jsonl"}))
    assert ok.config.train.eval_every == 2
    assert "eval_loss" in problems(workdir, base(checkpoint={"keep_best": "loss"}))["checkpoint.keep_best"]


def test_tracker_names_packages_and_options_are_checked(reg, workdir):
    got = problems(
        workdir,
        base(
            logging={
                "trackers": ["tensorbord", "needslib", "mlflow"],
                "options": {"mlflow": {"tracking_url": "x"}, "wandb": {"mode": "offline"}},
            }
        ),
    )
    assert "unknown tracker 'tensorbord'" in got["logging.trackers.0"]
    assert "did you mean 'tensorboard'" in got["logging.trackers.0"]
    assert "c.yaml" in got["logging.trackers.0"]
    missing = got["logging.trackers.1"]
    assert "disagg_no_such_module_xyz" in missing and "pip install disagg-no-such-lib" in missing
    assert "tracking_url" in got["logging.options.mlflow.tracking_url"]
    assert "does not name" in got["logging.options.wandb"]


def test_first_party_trackers_pass_when_installed(reg, workdir):
    for name in ("tensorboard", "mlflow", "wandb"):
        pytest.importorskip(name)
    cfg = base(
        logging={"trackers": ["tensorboard", "mlflow", "wandb"], "options": {"wandb": {"mode": "offline"}}}
    )
    assert check(workdir, cfg).config.logging.trackers == ["tensorboard", "mlflow", "wandb"]


class FakeOrch:
    """What ``save_checkpoint`` asks of an orchestrator: each group's files."""

    def save_full(self, path: str, sharded: bool = True) -> dict:
        from disagg.runtime.actor.state import file_digest

        f = Path(path) / "llm" / "full.safetensors"
        f.parent.mkdir(parents=True)
        f.write_bytes(b"weights")
        return {"llm/full.safetensors": file_digest(f)}


def test_keep_best_survives_keep_last(tmp_path):
    """Eval losses 3, 1, 2 with keep_last 1: step 2 (the best) stays beside step 3."""
    from disagg.runtime.evaluation import Evaluation
    from disagg.runtime.run import _save

    cfg = Config.model_validate(
        {
            "model": {"llm": {"family": "x", "path": "x"}},
            "checkpoint": {"keep_last": 1, "keep_best": "eval_loss"},
        }
    )
    ev = Evaluation(cfg, tmp_path, samples=None)
    for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0)):
        record = {"step": step, "eval_loss": loss}
        _save(FakeOrch(), cfg, tmp_path, step, None, ev, record if ev.improves(loss) else None)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert kept == ["step-2", "step-3"]
    best = json.loads((tmp_path / "checkpoints" / "best.json").read_text())
    assert best["step"] == 2 and best["eval_loss"] == 1.0
    # a resumed run continues the record: 1.5 does not beat 1.0
    assert not Evaluation(cfg, tmp_path, samples=None).improves(1.5)


def test_train_summary_names_the_eval_loss_and_the_best_checkpoint():
    from disagg.cli.train import format_summary
    from disagg.metrics.step import summarize

    rows = [
        {"step": s, "loss": 2.0 / s, "tokens_per_s": 10.0, "skipped_samples": 0, "dropped_too_long": 0}
        for s in (1, 2, 3)
    ]
    for r, ev in zip(rows, (1.5, 0.5, 0.75)):
        r["eval_loss"] = ev
    summary = summarize(rows, "runs/x")
    assert (summary["eval_loss"], summary["best_eval_loss"], summary["best_eval_step"]) == (0.75, 0.5, 2)
    summary["best_checkpoint"] = "runs/x/checkpoints/step-2"
    text = format_summary(summary)
    assert "eval loss: 0.7500 (best 0.5000 after step 2)" in text and "runs/x/checkpoints/step-2" in text


def test_docs_tracker_example_registers_and_logs(disagg_registry, capsys, tmp_path):
    """docs/plugins.md's tracker snippet, as written, is a working plugin."""
    import re
    import types

    from disagg.metrics.scalars import scalars
    from disagg.plugins import notify
    from disagg.runtime.tracking import start_trackers, stop_trackers

    page = (Path(__file__).resolve().parents[3] / "docs" / "plugins.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "class PrintTracker" in b]
    plugin = types.ModuleType("readme_tracker")
    exec("import disagg\n" + code, plugin.__dict__)
    reg = register_plugin(plugin, name="readme-tracker")
    assert "print" in reg.trackers
    cfg = Config.model_validate(
        {"model": {"llm": {"family": "x", "path": "x"}}, "logging": {"trackers": ["print"]}}
    )
    trackers = start_trackers(cfg, tmp_path, reg)
    try:
        record = {"step": 1, "loss": 2.5, "eval_loss": 2.25, "comm_bytes": {"llm": 7}}
        assert notify("disagg_log_metrics", pm=reg.pm, step=1, metrics=record, scalars=scalars(record)) == []
        notify("disagg_run_finished", pm=reg.pm, summary={"status": "ok"})
    finally:
        stop_trackers(trackers, reg.pm)
    out = capsys.readouterr().out
    assert f"run {tmp_path} project disagg" in out and "1 2.5 2.25" in out
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == record  # jsonl is always on
