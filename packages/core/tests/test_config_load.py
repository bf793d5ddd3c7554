"""YAML + --set -> Config: every error names file:line, key, bad value and what is allowed."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from disagg.config import Config, ConfigError, load_config, load_config_and_source
from disagg.config.dump import dump_resolved

BASE = """\
model:
  llm: {family: cfgtest, path: llm}
parallel:
  placement: collocated
  llm: {strategy: ddp, degree: 1, replicas: 2}
data:
  train: d.jsonl
  batch_size: 4
train:
  steps: 3
  lr: 1.0e-3
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def error_of(path: Path, overrides: tuple[str, ...] = ()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return info.value


def test_valid_file_loads(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert isinstance(cfg, Config)
    assert cfg.parallel.llm.replicas == 2 and cfg.train.lr == 1e-3 and cfg.modules() == ["llm"]


def test_typo_names_file_line_key_and_suggestion(tmp_path):
    p = write(tmp_path, BASE.replace("  steps: 3", "  stpes: 3"))
    err = error_of(p)
    (problem,) = err.problems
    assert problem.key == "train.stpes"
    assert problem.where == f"{p}:10"
    assert "unknown key 'stpes'" in problem.message and "did you mean 'steps'?" in problem.message
    assert "allowed: steps, epochs, eval_every, lr," in problem.message


def test_literal_names_value_and_choices(tmp_path):
    err = error_of(write(tmp_path, BASE.replace("placement: collocated", "placement: colocated")))
    text = str(err)
    assert ":4: parallel.placement: 'colocated' is not allowed" in text
    assert "allowed: collocated, disaggregated" in text and "did you mean 'collocated'" in text


def test_all_problems_reported_together(tmp_path):
    text = (
        BASE.replace("lr: 1.0e-3", "lr: -1")
        .replace("batch_size: 4", "batch_size: 0")
        .replace("model:", "modle:")
    )
    err = error_of(write(tmp_path, text))
    keys = {p.key for p in err.problems}
    assert {"modle", "train.lr", "data.batch_size"} <= keys
    lr = next(p for p in err.problems if p.key == "train.lr")
    assert "-1" in lr.message and "greater than 0" in lr.message
    assert str(err).startswith(f"{len(err.problems)} config errors:")


def test_union_noise_is_dropped(tmp_path):
    text = BASE.replace("  train: d.jsonl", "  train:\n    - {path: d.jsonl, wieght: 2}")
    err = error_of(write(tmp_path, text))
    assert [p.key for p in err.problems] == ["data.train.0.wieght"]
    assert "did you mean 'weight'" in err.problems[0].message
    assert err.problems[0].where.endswith(":8")


def test_missing_required_key(tmp_path):
    err = error_of(
        write(tmp_path, BASE.replace("  llm: {family: cfgtest, path: llm}\n", "  llm: {family: cfgtest}\n"))
    )
    assert [(p.key, p.message) for p in err.problems] == [("model.llm.path", "required key is missing")]


def test_set_overrides_are_yaml_scalars_and_create_sections(tmp_path):
    p = write(tmp_path, BASE)
    cfg, source = load_config_and_source(
        p,
        [
            "train.lr=2e-4",
            "parallel.llm.replicas=3",
            "train.clip_grad_norm=null",
            "train.modules.llm.freeze=true",
        ],
    )
    assert cfg.train.lr == 2e-4 and cfg.parallel.llm.replicas == 3 and cfg.train.clip_grad_norm is None
    assert cfg.train.modules["llm"].freeze is True
    assert source.where(("train", "lr")) == "--set train.lr=2e-4"
    assert source.where(("train", "steps")) == f"{p}:10"


def test_set_into_list_item(tmp_path):
    text = BASE.replace("  train: d.jsonl", "  train:\n    - {path: a.jsonl}\n    - {path: b.jsonl}")
    cfg = load_config(write(tmp_path, text), ["data.train.1.weight=3"])
    assert [e.weight for e in cfg.data.train] == [1.0, 3.0]


@pytest.mark.parametrize(
    ("override", "key", "needle"),
    [
        ("train.lrr=1", "train.lrr", "did you mean 'lr'"),
        ("train.lr=-1", "train.lr", "greater than 0"),
        ("parallel.llm.degree=two", "parallel.llm.degree", "'two' is invalid"),
        ("train.lr.x=1", "train.lr.x", "train.lr is a value, not a section"),
    ],
)
def test_bad_set_is_located_at_the_override(tmp_path, override, key, needle):
    err = error_of(write(tmp_path, BASE), (override,))
    (problem,) = err.problems
    assert problem.where == f"--set {override}" and problem.key == key and needle in problem.message


@pytest.mark.parametrize("override", ["train.lr", "=3", "train..lr=1"])
def test_malformed_set(tmp_path, override):
    err = error_of(write(tmp_path, BASE), (override,))
    assert "expected --set dotted.key=value" in str(err) and override in str(err)


def test_yaml_syntax_error_has_line(tmp_path):
    p = write(tmp_path, BASE.replace("  batch_size: 4", "  batch_size: [4"))
    err = error_of(p)
    assert f"{p}:" in str(err) and "invalid YAML" in str(err)


def test_duplicate_key_rejected(tmp_path):
    err = error_of(write(tmp_path, BASE + "  lr: 5.0e-3\n"))
    assert [(p.key, p.where.rsplit(":", 1)[1]) for p in err.problems] == [("train.lr", "12")]
    assert "appears twice" in str(err)


def test_missing_file_and_non_mapping(tmp_path):
    assert "does not exist" in str(error_of(tmp_path / "nope.yaml"))
    assert "must hold a mapping" in str(error_of(write(tmp_path, "- 1\n- 2\n")))


def test_dump_resolved_round_trips(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["train.lr=5e-4"])
    out = dump_resolved(cfg, tmp_path / "run")
    assert out == tmp_path / "run" / "config.yaml"
    assert yaml.safe_load(out.read_text())["train"]["lr"] == 5e-4
    assert load_config(out) == cfg
