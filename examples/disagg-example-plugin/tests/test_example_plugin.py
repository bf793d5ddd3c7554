"""The example plugin's own tests, written the way a plugin author would."""

import csv

import disagg_example_plugin.plugin as example
from disagg.plugins import notify, register_plugin


def test_registers_its_strategy(disagg_registry):
    reg = register_plugin(example, name="example")
    assert reg.strategies["example_ddp"] is example.ExampleDDP
    assert reg.plugins["example"].registered == {"strategies": ["example_ddp"]}


def test_logs_metrics_to_csv(disagg_registry, tmp_path, monkeypatch):
    out = tmp_path / "m.csv"
    monkeypatch.setenv(example.CSV_ENV, str(out))
    register_plugin(example, name="example")
    assert notify("disagg_log_metrics", step=1, metrics={"loss": 2.5, "comm_bytes": {"llm": 3}}) == []
    notify("disagg_log_metrics", step=2, metrics={"loss": 2.0})
    rows = list(csv.DictReader(out.open()))
    assert [(r["step"], r["loss"]) for r in rows] == [("1", "2.5"), ("2", "2.0")]
