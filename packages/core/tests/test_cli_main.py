"""The CLI's dispatch and error policy, in-process."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import yaml

from disagg.cli import main as cli
from disagg.plugins import register_plugin

sys.path.insert(0, str(Path(__file__).parent))
import disagg_cfgtest_plugin  # noqa: E402


@pytest.fixture
def valid_config(tmp_path, monkeypatch, disagg_registry):
    register_plugin(disagg_cfgtest_plugin, name="cfgtest")
    (tmp_path / "llm").mkdir()
    (tmp_path / "d.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    cfg = {"model": {"llm": {"family": "cfgtest", "path": "llm"}}, "data": {"train": "d.jsonl"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "c.yaml"


@pytest.fixture
def fake_runtime(monkeypatch):
    """Stands in for disagg.runtime.run so these tests never start Ray."""
    calls = []
    mod = types.ModuleType("disagg.runtime.run")

    def run_training(resolved, address=None):
        cfg = resolved.config
        calls.append((cfg, address))
        if cfg.train.steps == 13:
            raise RuntimeError("actor vision/rank 1 died")
        return {"status": "ok", "steps": 0, "run_dir": cfg.output_dir}

    mod.run_training = run_training
    monkeypatch.setitem(sys.modules, "disagg.runtime.run", mod)
    return calls


def test_valid_config_reaches_the_runtime_with_overrides(valid_config, fake_runtime, capsys):
    assert cli.main(["train", str(valid_config), "--set", "train.steps=7", "--address", "auto"]) == 0
    ((cfg, address),) = fake_runtime
    assert "run dir:" in capsys.readouterr().out  # the final summary names the run dir
    assert cfg.train.steps == 7 and address == "auto"


def test_address_defaults_to_config(valid_config, fake_runtime):
    assert cli.main(["train", str(valid_config), "--set", "ray.address=ray://head:10001"]) == 0
    assert fake_runtime[0][1] == "ray://head:10001"


def test_runtime_error_exits_1_without_traceback(valid_config, fake_runtime, capsys, monkeypatch):
    monkeypatch.delenv("DISAGG_TRACEBACK", raising=False)
    assert cli.main(["train", str(valid_config), "--set", "train.steps=13"]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: actor vision/rank 1 died" in err and "Traceback" not in err
    monkeypatch.setenv("DISAGG_TRACEBACK", "1")
    assert cli.main(["train", str(valid_config), "--set", "train.steps=13"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_config_error_exits_2(valid_config, capsys):
    assert cli.main(["train", str(valid_config), "--set", "train.lr=0"]) == 2
    err = capsys.readouterr().err
    assert "train.lr" in err and "greater than 0" in err


def test_every_command_module_has_the_protocol():
    for name, module_name in cli.COMMANDS.items():
        module = __import__(module_name, fromlist=["run"])
        assert isinstance(module.HELP, str) and callable(module.add_arguments) and callable(module.run), name
    parser = cli.build_parser()
    assert set(parser._subparsers._group_actions[0].choices) == set(cli.COMMANDS)  # noqa: SLF001
