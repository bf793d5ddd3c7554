"""``disagg train`` refuses bad configs before any actor starts.

Each bad config is a real ``disagg train CONFIG`` invocation (``main(argv)``);
the cases run in one subprocess — importing torch once instead of twenty
times on a small machine — which afterwards checks that Ray was never
initialized. Two cases also go through the installed ``disagg`` script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from disagg.plugins import install_command

HERE = Path(__file__).parent

RUNNER = textwrap.dedent(
    """
    import contextlib, io, json, sys
    import disagg_cfgtest_plugin
    from disagg.plugins import register_plugin
    from disagg.cli.main import main

    register_plugin(disagg_cfgtest_plugin, name="cfgtest")
    results = {}
    for name, argv in json.load(open(sys.argv[1])).items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as exc:  # argparse usage errors
                rc = exc.code
        ray = sys.modules.get("ray")
        results[name] = {"rc": rc, "stderr": err.getvalue(), "ray": bool(ray and ray.is_initialized())}
    json.dump(results, sys.stdout)
    """
)


def base() -> dict:
    return {
        "model": {
            "vision": {"family": "cfgtest", "path": "enc"},
            "llm": {"family": "cfgtest", "path": "llm"},
        },
        "parallel": {
            "vision": {"strategy": "cfgtest_sp", "degree": 2},
            "llm": {"strategy": "ddp", "replicas": 2},
        },
        "data": {"train": "d.jsonl", "media_root": ".", "batch_size": 4},
        "train": {"steps": 2, "lr": 1.0e-4, "microbatches": 2},
        "output_dir": "runs/x",
    }


def _set(path: str, value):
    def mutate(cfg: dict) -> None:
        *parents, last = path.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value

    return mutate


def _drop(path: str):
    def mutate(cfg: dict) -> None:
        *parents, last = path.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        del node[last]

    return mutate


# name -> (mutation of the base config, extra argv, substrings the message must contain)
CASES: dict[str, tuple] = {
    "typo_key": (_set("train.stesp", 3), [], ["train.stesp", "unknown key 'stesp'", "did you mean 'steps'"]),
    "typo_section": (
        lambda c: c.update(paralel=c.pop("parallel")),
        [],
        ["unknown key 'paralel'", "did you mean 'parallel'"],
    ),
    "unknown_strategy": (
        _set("parallel.llm.strategy", "dpp"),
        [],
        ["parallel.llm.strategy", "'dpp'", "allowed: cfgtest_sp, ddp"],
    ),
    "uninstalled_strategy": (
        _set("parallel.llm.strategy", "megatron_tp"),
        [],
        ["'megatron_tp'", install_command("disagg-llm-tp")],
    ),
    "uninstalled_family": (
        _set("model.vision.family", "qwen2_5_vl"),
        [],
        ["model.vision.family", install_command("disagg-vision-sp")],
    ),
    "unknown_family": (
        _set("model.llm.family", "gpt9"),
        [],
        ["model.llm.family", "'gpt9'", "installed llm families: cfgtest"],
    ),
    "ranks_mismatch": (_set("parallel.vision.ranks", 3), [], ["parallel.vision.ranks", "3", "2 × 1 = 2"]),
    "negative_lr": (_set("train.lr", -0.001), [], ["train.lr", "-0.001", "greater than 0"]),
    "missing_model_path": (
        _set("model.llm.path", "no/such/dir"),
        [],
        ["model.llm.path", "'no/such/dir' does not exist"],
    ),
    "missing_data_file": (
        _set("data.train", "nope.jsonl"),
        [],
        ["data.train", "'nope.jsonl' does not exist"],
    ),
    "unknown_placement": (
        _set("parallel.placement", "colocated"),
        [],
        ["parallel.placement", "'colocated'", "collocated, disaggregated"],
    ),
    "bad_strategy_option": (
        _set("parallel.vision.chunkz", 2),
        [],
        ["parallel.vision.chunkz", "allowed:", "did you mean 'chunks'"],
    ),
    "bad_strategy_option_value": (
        _set("parallel.vision.chunks", 0),
        [],
        ["parallel.vision.chunks", "0", "greater than 0"],
    ),
    "ddp_degree_2": (
        _set("parallel.llm.degree", 2),
        [],
        ["parallel.llm", "'ddp'", "degree must be 1, got 2"],
    ),
    "family_divisibility": (
        _set("parallel.vision.degree", 3),
        [],
        ["parallel.vision", "degree 3", "1, 2, 4"],
    ),
    "unknown_module_in_train_modules": (
        _set("train.modules", {"visoin": {"freeze": True}}),
        [],
        ["train.modules", "'visoin'", "vision, audio, llm"],
    ),
    "unconfigured_module_in_train_modules": (
        _drop("model.vision"),
        [],
        ["train.modules.vision", "allowed: llm"],
    ),
    "bad_set_key": (
        None,
        ["--set", "train.lrr=0.1"],
        ["--set train.lrr=0.1", "train.lrr", "did you mean 'lr'"],
    ),
    "malformed_set": (None, ["--set", "train.lr"], ["--set train.lr", "dotted.key=value"]),
    "batch_lt_microbatches": (_set("data.batch_size", 1), [], ["data.batch_size", "1", "microbatches = 2"]),
    "unknown_transport": (
        _set("parallel.transport", "carrier_pigeon"),
        [],
        ["parallel.transport", "'carrier_pigeon'", "allowed: auto, cuda_ipc, gloo, nccl, object_store"],
    ),
    "audio_group_without_model": (
        _set("parallel.audio", {"degree": 2}),
        [],
        ["parallel.audio", "model.audio is not configured"],
    ),
    "missing_config_file": (None, ["--set", "x=1"], ["does not exist"]),
}


def _prepare(root: Path) -> dict[str, list[str]]:
    for d in ("enc", "llm"):
        (root / d).mkdir()
    (root / "d.jsonl").write_text("{}\n")
    argvs = {}
    for name, (mutate, extra, _) in CASES.items():
        cfg = base()
        if name == "unconfigured_module_in_train_modules":
            cfg["train"]["modules"] = {"vision": {"freeze": True}}
            cfg["parallel"].pop("vision")
        if mutate is not None:
            mutate(cfg)
        path = root / f"{name}.yaml"
        if name != "missing_config_file":
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        argvs[name] = ["train", str(path), *extra]
    return argvs


def _env() -> dict[str, str]:
    # Only built-ins (and the test plugin the runner registers) load: the
    # result must not depend on which plugin packages this venv has.
    return {**os.environ, "DISAGG_PLUGINS": "", "PYTHONPATH": str(HERE), "DISAGG_TRACEBACK": ""}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    (root / "cases.json").write_text(json.dumps(_prepare(root)))
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(root / "cases.json")],
        cwd=root,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_config_fails_before_any_actor(results, name):
    r = results[name]
    assert r["rc"] == 2, r
    assert not r["ray"], "Ray was initialized for a config that is invalid"
    assert "Traceback" not in r["stderr"]
    for needle in CASES[name][2]:
        assert needle in r["stderr"], (needle, r["stderr"])


def test_at_least_ten_distinct_bad_configs():
    assert len(CASES) >= 10


def _script(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("disagg")
    return subprocess.run(
        [str(exe), *args], cwd=root, env={**_env(), **env}, capture_output=True, text=True, timeout=300
    )


def test_console_script_exit_code_and_traceback_switch(tmp_path):
    cfg = base()
    cfg["parallel"]["llm"]["strategy"] = "zero"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    quiet = _script(tmp_path, "train", "c.yaml")
    assert quiet.returncode == 2
    hint = install_command("disagg-zero")
    assert hint in quiet.stderr and "Traceback" not in quiet.stderr
    loud = _script(tmp_path, "train", "c.yaml", "--traceback")
    assert loud.returncode == 2 and "Traceback" in loud.stderr and hint in loud.stderr
