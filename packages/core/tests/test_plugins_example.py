"""The example third-party plugin, pip-installed for real, shows up and is called."""

from __future__ import annotations

import csv
import importlib.metadata as md
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "disagg-example-plugin"
DIST = "disagg-example-plugin"


def _installed() -> bool:
    try:
        md.distribution(DIST)
        return True
    except md.PackageNotFoundError:
        return False


@pytest.fixture(scope="module")
def example_installed():
    """Installs the example (unless nox already did) and uninstalls it afterwards."""
    already = _installed()
    if not already:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "-e",
                str(EXAMPLE),
            ],
            check=True,
            timeout=600,
        )
    try:
        yield
    finally:
        if not already:
            subprocess.run(
                [sys.executable, "-m", "pip", "uninstall", "-y", "-q", DIST], check=True, timeout=600
            )


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "DISAGG_PLUGINS"}
    full_env.update(env)
    return subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=300)


def _plugins_json(tmp_path: Path, **env: str) -> dict:
    proc = _run([str(Path(sys.executable).with_name("disagg")), "plugins", "--json"], tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_plugins_json_lists_builtins_and_example(example_installed, tmp_path):
    data = _plugins_json(tmp_path)
    by_name = {p["name"]: p for p in data["plugins"]}
    builtin = by_name["disagg.builtin"]["registered"]
    assert "ddp" in builtin["strategies"]
    assert {"object_store", "gloo", "nccl"} <= set(builtin["transports"])
    example = by_name["example"]
    assert example["version"] == "0.1.0"
    assert example["hooks"] == ["disagg_log_metrics", "disagg_register_strategies"]
    assert example["registered"] == {"strategies": ["example_ddp"]}


def test_disagg_plugins_env_limits_loading(example_installed, tmp_path):
    only = _plugins_json(tmp_path, DISAGG_PLUGINS="example")
    names = {p["name"] for p in only["plugins"]}
    assert "example" in names and all(n == "example" or n.startswith("disagg.") for n in names)
    none = _plugins_json(tmp_path, DISAGG_PLUGINS="")
    assert "disagg.builtin" in {p["name"] for p in none["plugins"]}
    assert all(p["name"].startswith("disagg.") for p in none["plugins"])


def test_example_logger_is_called(example_installed, tmp_path):
    out = tmp_path / "metrics.csv"
    code = (
        "from disagg.plugins import notify\n"
        "for step in (1, 2):\n"
        "    metrics = {'loss': 3.0 / step, 'comm_bytes': {}}\n"
        "    assert notify('disagg_log_metrics', step=step, metrics=metrics) == []\n"
    )
    proc = _run([sys.executable, "-c", code], tmp_path, DISAGG_EXAMPLE_CSV=str(out), DISAGG_PLUGINS="example")
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(out.open()))
    assert [(r["step"], float(r["loss"])) for r in rows] == [("1", 3.0), ("2", 1.5)]


def test_example_strategy_options_are_validated(example_installed, tmp_path):
    (tmp_path / "c.yaml").write_text(
        "model: {llm: {family: nope, path: .}}\nparallel: {llm: {strategy: example_ddp, log_evry: 2}}\n"
    )
    proc = _run(
        [str(Path(sys.executable).with_name("disagg")), "train", "c.yaml"], tmp_path, DISAGG_PLUGINS="example"
    )
    assert proc.returncode == 2
    assert "parallel.llm.log_evry" in proc.stderr and "did you mean 'log_every'" in proc.stderr
    assert "Traceback" not in proc.stderr
