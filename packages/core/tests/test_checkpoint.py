"""Checkpoints you can trust, on the toy families: a driver SIGKILLed in the
middle of a save leaves the previous checkpoint complete and resumable, a truncated file
is refused by its checksum, ``keep_last`` prunes, and a rank killed mid-run is
recovered from the newest checkpoint with the undisturbed run's losses."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disagg.config.schema import Config
from disagg.config.validate import validate
from disagg.runtime import checkpoint as ckpt
from disagg.runtime.orchestrator import Orchestrator
from disagg.runtime.run import run_training
from disagg.testing import toy
from disagg.testing.toy import ToyDataSource, make_toy_dirs

STEPS = 5
#: Ray's agents (process titles, command lines), which outlive their raylet for a while
#: (see the driver-kill test)
RAY_AGENTS = (
    "ray::DashboardAgent",
    "ray::RuntimeEnvAgent",
    "dashboard/agent.py",
    "runtime_env/agent/main.py",
)


@pytest.fixture(scope="module")
def toy_registry():
    """Built-ins plus the toy families, process-wide for this module's runs."""
    from disagg import plugins

    previous = plugins._REGISTRY  # noqa: SLF001 - restored exactly afterwards
    pm, _ = plugins.make_plugin_manager(load_entry_points=False)
    pm.register(toy, name="disagg.testing.toy")
    reg = plugins.build_registry(pm)
    plugins.set_registry(reg)
    try:
        yield reg
    finally:
        plugins.set_registry(previous)


def _cfg(root: Path, dirs, out: str, **over) -> Config:
    enc, lm = dirs
    raw = {
        "model": {"vision": {"family": "toy", "path": str(enc)}, "llm": {"family": "toy", "path": str(lm)}},
        "parallel": {"vision": {"replicas": 2}, "llm": {"replicas": 1}},
        "train": {"steps": STEPS, "lr": 1e-2, "clip_grad_norm": 1.0, "weight_decay": 0.1},
        "checkpoint": {"every": 2},
        "output_dir": str(root / out),
    }
    for k, v in over.items():
        raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) else v
    return Config.model_validate(raw)


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "step" in r}  # the last line of a step wins


def _train(cfg: Config, registry) -> dict:
    return run_training(
        validate(cfg, registry), registry=registry, data_source=ToyDataSource(4), progress=False
    )


@pytest.fixture(scope="module")
def undisturbed(ray_local, toy_registry, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    dirs = make_toy_dirs(root / "models")
    cfg = _cfg(root, dirs, "plain", checkpoint={"format": "full"})  # the merged form (the default shards)
    _train(cfg, toy_registry)
    return root, dirs, _losses(root / "plain")


def _kill_mid_save(config: Path, step: int, log: Path) -> dict:
    """Run ``checkpoint_driver.py`` until its save of ``step`` has every shard
    on disk but no manifest, SIGKILL it, and return the processes it had
    started (its Ray) as they were at the kill, with their command lines."""
    import psutil

    ready = log.with_name("ready")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("checkpoint_driver.py")),
                str(config),
                str(step),
                str(ready),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 600
        while not ready.exists():
            assert proc.poll() is None, f"the driver exited before the save:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"no save of step {step} within 600 s:\n{log.read_text()[-3000:]}"
            )
            time.sleep(0.2)
        assert int(ready.read_text()) == proc.pid
        # cmdlines now: a process that exits later has none to read
        children = {
            p: " ".join(p.cmdline()).strip() for p in psutil.Process(proc.pid).children(recursive=True)
        }
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:  # an assertion above failed: leave nothing running
            proc.kill()
            proc.wait()
    return children


def test_driver_killed_mid_save_leaves_the_previous_checkpoint(
    undisturbed, toy_registry, tmp_path, monkeypatch, capsys
):
    import psutil

    from disagg.cli.main import main
    from disagg.config.dump import dump_resolved

    root, dirs, losses = undisturbed
    run = root / "killed"
    config = dump_resolved(_cfg(root, dirs, "killed"), tmp_path)
    children = _kill_mid_save(config, 4, tmp_path / "driver.log")
    # The driver's own Ray (GCS, raylet, workers) dies with it. Ray's dashboard and runtime-env
    # agents log "raylet is dead, exiting" at once but linger in their shutdown: they are not
    # waited for but ended here, by pid (they are this test's), as is anything else left over
    # once the test has failed.
    agents = [p for p, cmd in children.items() if any(a in cmd for a in RAY_AGENTS)]
    _, alive = psutil.wait_procs([p for p in children if p not in agents], timeout=60)
    for p in agents + alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(agents + alive, timeout=30)
    assert not alive, f"Ray processes outlived the killed driver: {[children[p] for p in alive]}"

    stale = run / "checkpoints" / "step-4.tmp"
    assert not (stale / ckpt.MANIFEST).exists(), "killed before the manifest"
    # the default, sharded: every rank's own file
    parts = ("vision/dcp/__0_0.distcp", "vision/dcp/__1_0.distcp", "vision/dcp/.metadata")
    for part in (*parts, "llm/dcp/.metadata", "meta.json"):
        assert (stale / part).is_file(), f"killed after the shards were written: {part} is missing"
    assert ckpt.latest_checkpoint(run) == run / "checkpoints" / "step-2", "the .tmp is not a checkpoint"
    manifest = ckpt.verify_checkpoint(run / "checkpoints" / "step-2")  # every checksum holds
    assert manifest["layout"]["vision"] == {"strategy": "ddp", "degree": 1, "replicas": 2}
    for part in ("vision/dcp/__1_0.distcp", "vision/dcp/.metadata", "llm/schedule.json"):
        assert part in manifest["files"]
    assert "vision/rng/rank-1.safetensors" in manifest["files"]
    assert sorted(_losses(run)) == [1, 2, 3, 4], "the killed run logged steps 1-4"

    # `disagg train --resume auto` continues from step-2, over the stale step-4.tmp
    monkeypatch.setattr("disagg.data.build_data_source", lambda cfg, families: ToyDataSource(4))
    assert main(["train", str(config), "--resume", "auto"]) == 0
    assert f"resuming from {run / 'checkpoints' / 'step-2'}" in capsys.readouterr().err
    got = _losses(run)
    assert [got[s] for s in range(1, STEPS + 1)] == [losses[s] for s in range(1, STEPS + 1)]  # exact
    assert not stale.exists(), "the next save of step 4 replaced the stale .tmp"
    ckpt.verify_checkpoint(run / "checkpoints" / "step-4")


def test_truncated_file_is_refused_and_keep_last_prunes(undisturbed, toy_registry, tmp_path):
    import shutil

    root, dirs, _ = undisturbed
    src = root / "plain" / "checkpoints" / "step-4"
    bad = tmp_path / "step-4"
    shutil.copytree(src, bad)
    f = bad / "llm" / "optim.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(ckpt.CheckpointError, match=r"llm/optim.safetensors fails its checksum.*truncated"):
        ckpt.verify_checkpoint(bad)
    cfg = _cfg(root, dirs, "refused", checkpoint={"resume_from": str(bad)})
    with pytest.raises(ckpt.CheckpointError, match="fails its checksum"):
        _train(cfg, toy_registry)
    (bad / ckpt.MANIFEST).unlink()
    with pytest.raises(ckpt.CheckpointError, match="its save did not finish"):
        ckpt.verify_checkpoint(bad)
    # keep_last: 1 leaves only the final checkpoint
    pruned = _cfg(root, dirs, "pruned", checkpoint={"keep_last": 1}, train={"steps": 4})
    _train(pruned, toy_registry)
    assert [p.name for p in ckpt.complete_checkpoints(root / "pruned")] == ["step-4"]


def test_sharded_checkpoints_resume_and_export(undisturbed, toy_registry, tmp_path):
    """``checkpoint.format: sharded`` (the default): each rank writes its own
    ``torch.distributed.checkpoint`` file (the vision group's two replicas about half of its
    state each, nothing merged), ``keep_last`` prunes, training is unchanged, a run resumed
    from it (saving the full form) continues the undisturbed losses bit for bit, and
    ``disagg export`` reads it without actors: the same tensors as the export of the
    full-form checkpoint of the same step."""
    from safetensors.torch import load_file

    from disagg.runtime.export import export_checkpoint

    root, dirs, losses = undisturbed
    cfg = _cfg(root, dirs, "sharded", checkpoint={"every": 2, "keep_last": 2})
    assert cfg.checkpoint.format == "sharded"
    _train(cfg, toy_registry)
    assert _losses(root / "sharded") == losses
    assert [p.name for p in ckpt.complete_checkpoints(root / "sharded")] == ["step-4", "step-5"]
    step4 = root / "sharded" / "checkpoints" / "step-4"
    files = ckpt.verify_checkpoint(step4)["files"]
    for m, world in (("vision", 2), ("llm", 1)):
        assert {f"{m}/dcp/__{r}_0.distcp" for r in range(world)} | {f"{m}/dcp/.metadata"} <= set(files)
        assert f"{m}/full.safetensors" not in files and f"{m}/optim.safetensors" not in files
    halves = [files[f"vision/dcp/__{r}_0.distcp"]["bytes"] for r in (0, 1)]
    assert 0.3 < halves[0] / sum(halves) < 0.7, halves

    resumed = _cfg(
        root, dirs, "from-sharded", checkpoint={"every": 2, "format": "full", "resume_from": str(step4)}
    )
    _train(resumed, toy_registry)
    assert _losses(root / "from-sharded")[STEPS] == losses[STEPS]

    export_checkpoint(step4, tmp_path / "sharded", toy_registry)
    export_checkpoint(root / "plain" / "checkpoints" / "step-4", tmp_path / "full", toy_registry)
    exported = sorted(p.relative_to(tmp_path / "full") for p in (tmp_path / "full").rglob("*.safetensors"))
    assert exported
    for rel in exported:
        got, want = load_file(str(tmp_path / "sharded" / rel)), load_file(str(tmp_path / "full" / rel))
        assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want), rel


def _kill_at(step: int, module_index: int, rank: int, monkeypatch) -> list[int]:
    """Kill one actor's process by pid at the start of ``step`` (once)."""
    killed: list[int] = []
    real_step = Orchestrator.step

    def step_and_kill(self, batch, *args, **kwargs):
        # a restarted run's new orchestrator counts from 0 again: kill once only
        if not killed and self.steps_done + 1 == step:
            import ray

            pid = ray.get(self.groups[module_index].actors[rank].placement.remote())["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return real_step(self, batch, *args, **kwargs)

    monkeypatch.setattr(Orchestrator, "step", step_and_kill)
    return killed


def test_killed_rank_is_recovered_from_the_newest_checkpoint(undisturbed, toy_registry, monkeypatch):
    root, dirs, losses = undisturbed
    killed = _kill_at(4, 0, 1, monkeypatch)  # vision rank 1, during step 4: step-2 is the newest
    cfg = _cfg(root, dirs, "recovered", fault_tolerance={"max_restarts": 1})
    summary = _train(cfg, toy_registry)
    assert killed and summary["status"] == "ok" and summary["restarts"] == 1
    run = root / "recovered"
    got = _losses(run)
    assert got[STEPS] == losses[STEPS], "the final loss equals the undisturbed run's"
    assert [got[s] for s in range(1, STEPS + 1)] == [losses[s] for s in range(1, STEPS + 1)]
    (event,) = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert event["rank"] == "module 'vision' rank 1" and event["action"].endswith("step-2")
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in logged if "event" in r] == ["actor_died"]


def test_restarts_exhausted_names_module_and_rank(undisturbed, toy_registry, monkeypatch):
    from disagg.runtime.recovery import RestartsExhausted

    root, dirs, _ = undisturbed
    _kill_at(2, 1, 0, monkeypatch)  # the LLM's only rank
    cfg = _cfg(root, dirs, "exhausted")  # max_restarts: 0
    with pytest.raises(RestartsExhausted, match=r"module 'llm' rank 0 died.*max_restarts is 0"):
        _train(cfg, toy_registry)


def test_resume_auto_picks_the_newest_complete_checkpoint(tmp_path, capsys):
    from disagg.cli.train import _resume_path

    root = tmp_path / "run" / "checkpoints"
    for name, complete in (("step-9", True), ("step-10", True), ("step-12.tmp", True), ("step-11", False)):
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / ckpt.MANIFEST).write_text("{}")
    assert _resume_path("auto", str(tmp_path / "run")) == str(root / "step-10")  # numeric, complete only
    assert _resume_path("some/where", str(tmp_path / "run")) == "some/where"
    assert _resume_path("auto", str(tmp_path / "empty")) is None
    assert "starting at step 0" in capsys.readouterr().err
