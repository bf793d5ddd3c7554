"""``run_training`` end to end with the toy families: metrics, checkpoints,
export, resume, failures, and a simulated two-node cluster."""

from __future__ import annotations

import json

import pytest

from disagg.config.schema import Config
from disagg.config.validate import validate
from disagg.runtime.export import export_checkpoint
from disagg.runtime.run import run_training
from disagg.testing import toy
from disagg.testing.tolerance import assert_exact
from disagg.testing.toy import ToyDataSource, ToyLM, make_toy_dirs


@pytest.fixture
def toy_registry(disagg_registry):
    from disagg.plugins import register_plugin

    return register_plugin(toy, name="disagg.testing.toy")


def _cfg(tmp_path, dirs, **over):
    enc, lm = dirs
    raw = {
        "model": {"vision": {"family": "toy", "path": str(enc)}, "llm": {"family": "toy", "path": str(lm)}},
        "parallel": {"vision": {"replicas": 2}, "llm": {"replicas": 1}},
        "train": {"steps": 4, "lr": 1e-2, "clip_grad_norm": 1.0},
        "checkpoint": {"every": 2},
        "output_dir": str(tmp_path / "run"),
    }
    for k, v in over.items():
        raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) else v
    return Config.model_validate(raw)


def test_run_writes_metrics_checkpoints_and_exports(ray_local, toy_registry, tmp_path):
    dirs = make_toy_dirs(tmp_path / "models")
    cfg = _cfg(tmp_path, dirs)
    summary = run_training(
        validate(cfg, toy_registry), registry=toy_registry, data_source=ToyDataSource(4), progress=False
    )
    run = tmp_path / "run"
    assert summary["status"] == "ok" and summary["steps"] == 4
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    for r in lines:
        for key in ("loss", "grad_norm", "step_time_s", "tokens_per_s", "peak_mem_bytes", "comm_bytes"):
            assert key in r
        assert set(r["peak_mem_bytes"]) == {"vision", "llm"} and r["peak_mem_bytes"]["llm"] > 0
        # two vision replicas all-reduce their gradients; shards and gradients cross groups
        assert r["comm_bytes"]["vision"] > 0 and r["comm_bytes"]["llm"] > 0
    assert any(run.glob("*.yaml")), "the resolved config is written to the run dir"
    # busy time is the step's own (set-up and checkpoints were charged to a step: 9.2 s in 0.44 s)
    for r in lines:
        assert all(0 < b <= r["step_time_s"] for b in r["busy_s"].values()), (r["step"], r["busy_s"])
    # train.log: one line per logged step with loss, lr and grad_norm, for tail -f
    assert _train_log_steps(run) == [
        f"step {r['step']}/4 loss {r['loss']:.4f} lr {r['lr']['llm']:.3g} grad_norm {r['grad_norm']:.4g}"
        for r in lines
    ]
    assert (run / "checkpoints" / "step-2" / "meta.json").exists()
    last = run / "checkpoints" / "step-4"
    out = export_checkpoint(last, tmp_path / "export", toy_registry)
    assert sorted(p.name for p in out) == ["llm", "vision"]  # two source dirs -> one HF dir each
    # the same through the CLI (the toy family is registered in this process)
    from disagg.cli.main import main

    assert main(["export", str(last), str(tmp_path / "export-cli")]) == 0
    assert main(["export", str(tmp_path), str(tmp_path / "x")]) == 2  # not a checkpoint: config error
    # the LLM's export loads with from_pretrained and equals the trained weights
    lm_dir = tmp_path / "export-cli" / "llm"
    model = ToyLM.from_pretrained(lm_dir)
    from disagg.runtime.actor.state import read_module_state

    trained = read_module_state(last, "llm")[0]
    assert_exact(model.state_dict(), trained, "exported ")

    # resume from step 2 reproduces steps 3 and 4 exactly (bit for bit: the same kernels on the same
    # machine run the same operations on the same operands; disagg.testing.tolerance)
    cfg2 = _cfg(
        tmp_path,
        dirs,
        output_dir=str(tmp_path / "resumed"),
        checkpoint={"every": 0, "resume_from": str(run / "checkpoints" / "step-2")},
    )
    summary2 = run_training(
        validate(cfg2, toy_registry), registry=toy_registry, data_source=ToyDataSource(4), progress=False
    )
    resumed = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [3, 4]
    # the summary counts the steps this invocation ran, not the checkpoint's
    from disagg.cli.train import format_summary

    assert (summary2["steps"], summary2["steps_run"]) == (4, 2)
    assert format_summary(summary2).startswith("trained 2 steps (3-4, resumed at step 2)")
    assert [x.split(" loss")[0] for x in _train_log_steps(tmp_path / "resumed")] == ["step 3/4", "step 4/4"]
    for a, b in zip(resumed, lines[2:]):
        assert a["loss"] == b["loss"], (a["step"], a["loss"], b["loss"])


def _train_log_steps(run_dir) -> list[str]:
    """train.log's step lines, from ``step`` up to ``tokens/s`` (time stamp and rate cut)."""
    import re

    text = (run_dir / "train.log").read_text()
    return re.findall(r"^\S+ \S+ (step \d+/\d+ loss .*?) tokens/s ", text, re.M)


def test_actor_failure_names_module_and_rank(ray_local, toy_registry, tmp_path):
    from disagg.runtime.orchestrator import GroupFailure

    dirs = make_toy_dirs(tmp_path / "models")
    cfg = _cfg(tmp_path, dirs, train={"steps": 2})

    class Broken(ToyDataSource):
        def batch(self, step):
            samples = super().batch(step)
            samples[-1]["vision"]["patches"] = samples[-1]["vision"]["patches"][:, :2]  # wrong width
            return samples

    with pytest.raises(GroupFailure, match=r"module 'vision' rank 1"):
        run_training(
            validate(cfg, toy_registry),
            registry=toy_registry,
            data_source=Broken(4, text_only_every=0),
            progress=False,
        )
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"
