"""``python -m disagg.gpucheck --device cpu`` as a bare GPU host runs it: in a subprocess in
which ``import ray`` fails. The check passes with its four parts and both injected faults
caught; with one fault left uncaught (the test hook) or a strategy's plugin missing, it fails;
its calibration file loads into ``disagg plan --calibration`` and changes the plan's time;
``--device cuda`` without a usable GPU is an error, never a skip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_zero")

#: run the check with a finder first on sys.meta_path that refuses ``ray`` (as on a host
#: without its wheel): any import of it, direct or through a disagg module, raises
NO_RAY = """
import runpy, sys
class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("ray is not installed on this host (blocked by the test)")
sys.meta_path.insert(0, NoRay())
sys.argv = ["python -m disagg.gpucheck", *sys.argv[1:]]
runpy.run_module("disagg.gpucheck", run_name="__main__")
"""


def gpucheck(tmp: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict, str]:
    out = tmp / "report.json"
    proc = subprocess.run(
        [sys.executable, "-c", NO_RAY, "--device", "cpu", "--out", str(out), *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, report, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def passed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpucheck")
    rc, report, log = gpucheck(tmp, "--work", str(tmp / "work"))
    return tmp, rc, report, log


def test_cpu_check_passes_without_ray(passed):
    _, rc, report, log = passed
    assert rc == 0, log[-4000:]
    assert report["ok"] and report["failures"] == []
    parts = report["parts"]
    assert set(parts) == {"correctness", "calibration", "memory", "mechanism"}
    assert all(p["ok"] for p in parts.values())
    corr = parts["correctness"]
    want = {"ddp", "ulysses", "megatron_tp", "megatron_tp+sp", "zero1", "zero3", "shard_parameters"}
    assert set(corr["layouts"]) == want and corr["excluded"] == []
    for name, rec in corr["layouts"].items():
        assert rec["ok"], (name, rec["failures"])
        assert all(0 <= m <= 1 for m in rec["margins"].values()), (name, rec["margins"])
    faults = corr["faults"]
    assert set(faults) == {"skip_step", "noise_images"}
    assert all(f["injected"] and f["caught"] for f in faults.values()), faults
    # images matter: the noise run is caught by its first step already (before any update)
    assert "step 1" in faults["noise_images"]["first_failure"]
    # on cpu the allocator peak is not read, and says so; the prediction is still there
    for part in ("vision_block", "llm_layer"):
        rec = parts["memory"][part]
        assert rec["measured_bytes"] is None and "not available on cpu" in rec["measured"]
        assert rec["predicted_bytes"] > 0
    # per layout, the allocator's peak (not read on cpu, and it says so) beside the model's bytes
    predicted = {}
    for name, rec in corr["layouts"].items():
        mem = rec["memory"]
        assert mem["measured_bytes"] is None and "not available on cpu" in mem["measured"], name
        if mem["predicted_bytes"] is not None:
            p = mem["predicted_bytes"]
            assert p["total"] == p["vision"] + p["llm"] and p["vision"] > 0 and p["llm"] > 0, name
            predicted[name] = p["total"]
    assert set(predicted) >= want - {"shard_parameters"}, predicted  # ddp's LLM states no cost sharded
    assert predicted["zero3"] > predicted["zero1"]  # stage 3 also charges its gathered weights
    mech = parts["mechanism"]
    assert mech["ulysses_over_tp_throughput"] > 0 and set(mech["strategy_mfu"]) == want
    assert Path(parts["calibration"]["file"]).is_file()


def test_an_uncaught_fault_or_a_missing_plugin_fails_the_check(tmp_path):
    """The hook leaves the noise-images fault out (an honest run: nothing can catch it), and the
    zero plugin is not loaded while its layouts are not excluded: the check must say both."""
    env = {"DISAGG_GPUCHECK_UNCAUGHT": "noise_images", "DISAGG_PLUGINS": "vision_sp,llm_tp"}
    rc, report, log = gpucheck(
        tmp_path, "--parts", "correctness", "--exclude", "ulysses,megatron_tp,shard_parameters", env=env
    )
    assert rc == 1, log[-4000:]
    faults = report["parts"]["correctness"]["faults"]
    assert faults["noise_images"] == {**faults["noise_images"], "injected": False, "caught": False}
    assert faults["skip_step"]["caught"]
    assert "injected fault 'noise_images' was not caught" in report["failures"]
    layouts = report["parts"]["correctness"]["layouts"]
    assert layouts["ddp"]["ok"]
    for name in ("zero1", "zero3"):
        assert not layouts[name]["ok"] and "strategy 'zero' is not registered" in layouts[name]["failures"][0]


def test_calibration_file_feeds_the_planner(passed, capsys):
    import yaml

    from disagg.cli.main import main
    from disagg.plan.cluster import load_cluster

    tmp, rc, report, _ = passed
    assert rc == 0
    cal = report["parts"]["calibration"]
    cluster = load_cluster(cal["file"])
    assert cluster.to_dict() == cal["cluster"] and "gpucheck" in cluster.source
    work = tmp / "work"
    model = work / "tiny" / "qwen2_5_vl"
    (work / "train.jsonl").write_text(
        json.dumps(
            {
                "image": "s0_0.png",
                "conversations": [
                    {"from": "human", "value": "<image>\nDescribe."},
                    {"from": "gpt", "value": "A shape."},
                ],
            }
        )
        + "\n"
    )
    cfg = {
        "model": {
            "vision": {"family": "qwen2_5_vl", "path": str(model)},
            "llm": {"family": "qwen2_5_vl", "path": str(model)},
        },
        "parallel": {},
        "data": {"train": str(work / "train.jsonl"), "media_root": str(work), "batch_size": 2},
        "train": {"seed": 0, "lr": 1.0e-3, "steps": 2},
        "output_dir": str(tmp / "run"),
    }
    (tmp / "base.yaml").write_text(yaml.safe_dump(cfg))
    best = {}
    for name, flags in (("preset", ["--cluster", "cpu"]), ("calibrated", ["--calibration", cal["file"]])):
        out = tmp / f"{name}.json"
        argv = [
            "plan",
            str(tmp / "base.yaml"),
            *flags,
            "--gpus",
            "2",
            "--vision-tokens",
            "256",
            "--json",
            str(out),
        ]
        assert main([*argv, "--text-tokens", "32", "--top", "50"]) == 0
        best[name] = json.loads(out.read_text())
    capsys.readouterr()
    # the calibrated figures, with the command line's --gpus on top
    got = best["calibrated"]["cluster"]
    assert {k: got[k] for k in ("peak_flops", "mfu", "gemm_ridge", "mem_bw", "source")} == {
        k: cal["cluster"][k] for k in ("peak_flops", "mfu", "gemm_ridge", "mem_bw", "source")
    }
    # the same layout, timed by each machine description: the calibration changes the prediction
    preset = {x["name"]: x["step_time_s"] for x in best["preset"]["ranked"]}
    calibrated = {x["name"]: x["step_time_s"] for x in best["calibrated"]["ranked"]}
    common = sorted(set(preset) & set(calibrated))
    assert common and all(calibrated[n] != preset[n] for n in common), (preset, calibrated)
    # and the published prediction (disagg bench --predict --calibration) takes it too
    from disagg.bench.published import predict_published

    rows = {m: predict_published([4096], recompute=("full",), machine=m) for m in (None, cluster)}
    assert [r["layout"] for r in rows[None]] == [r["layout"] for r in rows[cluster]]
    assert all(a["step_time_s"] != b["step_time_s"] for a, b in zip(rows[None], rows[cluster]))


def test_allocator_peak_is_the_cuda_peak_above_what_was_there(monkeypatch):
    """The CUDA reading of :func:`disagg.gpucheck.layout_memory.allocator_peak`, on an allocator
    faked on CPU: the peak over the block less what was allocated before it, and the ratio to the
    prediction; the peak statistics are reset at the block's start (a stale peak is not read)."""
    from disagg.gpucheck import layout_memory as L

    state = {"allocated": 1000, "peak": 9000, "resets": 0}

    def reset(device):
        state["resets"] += 1
        state["peak"] = state["allocated"]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    with L.allocator_peak(torch.device("cuda", 0)) as peak:
        state["peak"] = 5000  # the layout's steps
        state["allocated"] = 1200
    assert state["resets"] == 1
    assert peak["measured_bytes"] == 4000 and peak["allocated_before_bytes"] == 1000
    rec = L.memory_record(peak, {"vision": 1500, "llm": 500, "total": 2000})
    assert rec["measured_over_predicted"] == 2.0 and rec["predicted_bytes"]["total"] == 2000


@pytest.mark.skipif(torch.cuda.is_available(), reason="a usable GPU is here: no error to show")
def test_cuda_without_a_usable_gpu_is_an_error(tmp_path):
    from disagg.gpucheck.__main__ import main

    out = tmp_path / "r.json"
    assert main(["--device", "cuda", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert not report["parts"] and "--device cuda" in report["error"]
