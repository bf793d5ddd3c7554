"""Metrics defined once (``disagg.metrics.fields``): the group reduction, the step record and
docs/metrics.md are generated from the one table; train.log's line; busy time charged only to
steps; the resume summary."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from disagg.metrics.fields import EVAL_FIELDS, FIELDS, REDUCED
from disagg.metrics.record import RankRecord, StepResult, reduce_group
from disagg.metrics.reference import END, PAGE, START, render, sync
from disagg.metrics.step import eval_fields, step_record, summarize

DOCS = Path(__file__).resolve().parents[3] / PAGE


def test_metrics_page_is_in_sync():
    assert sync(DOCS, write=False), f"{PAGE} is stale: run python -m disagg.metrics.reference {PAGE}"
    text = DOCS.read_text()
    assert START in text and END in text
    for f in (*FIELDS, *EVAL_FIELDS):
        assert f"| `{f.name}` |" in render(), f.name
        assert f.doc and f.unit is not None, f.name


def test_a_stale_page_is_detected(tmp_path):
    page = tmp_path / "metrics.md"
    page.write_text(DOCS.read_text().replace("| `wait_s` |", "| `waited_s` |"))
    assert not sync(page, write=False)
    assert sync(page, write=True) is False and sync(page, write=False)


def _records() -> list[RankRecord]:
    a = RankRecord(
        "llm", 0, busy_s=1.0, wait_s=0.5, sent_bytes=10, lr=0.1, collective_bytes={"all_reduce": 4}
    )
    b = RankRecord(
        "llm", 1, busy_s=2.0, wait_s=0.25, sent_bytes=3, lr=0.1, collective_bytes={"all_gather": 7}
    )
    a.collective_calls, b.collective_calls = {"all_reduce": 2}, {"all_reduce": 1, "all_gather": 5}
    return [a, b]


def test_reduce_group_and_step_record_come_from_the_table():
    g = reduce_group(_records())
    assert list(g) == [f.name for f in REDUCED]
    assert g["busy_s"] == 2.0 and g["wait_s"] == 0.5 and g["lr"] == 0.1
    assert g["comm_bytes"] == (4 + 10) + (7 + 3) and g["comm_bytes_per_rank"] == 14
    assert g["collective_bytes_per_rank"] == {"all_gather": 7, "all_reduce": 4}
    assert g["collective_calls_per_rank"] == {"all_gather": 5, "all_reduce": 2}
    res = StepResult(
        loss=2.0,
        grad_norm=1.5,
        label_tokens=10,
        tokens=100,
        step_time_s=4.0,
        groups={"llm": g},
        records={"llm": _records()},
        module_tokens={"llm": 100},
    )
    rec = step_record(3, res, {"skipped": 1}, flops={"llm": 8e9}, peak_flops=1e9)
    assert list(rec) == [f.name for f in FIELDS]
    assert rec["step"] == 3 and rec["tokens_per_s"] == 25.0 and rec["skipped_samples"] == 1
    assert rec["busy_s"] == {"llm": 2.0}
    # per group: 8e9 FLOPs over 4 s on 2 ranks of 1 GFLOP/s each; 100 tokens / 4 s / 2 ranks
    assert rec["flops"] == {"llm": 8e9} and rec["mfu"] == {"llm": pytest.approx(1.0)}
    assert rec["active_tokens_per_s_per_device"] == {"llm": 12.5}
    assert rec["idle_fraction"] == {"llm": 0.125}
    # no FLOP count (a family without a shape), no peak: left out, not zero
    bare = step_record(3, res, {}, flops={}, peak_flops=None)
    assert bare["flops"] == {} and bare["mfu"] == {}
    ev = {
        "loss": 1.0,
        "token_accuracy": 0.5,
        "label_tokens": 3,
        "samples": 2,
        "tokens": {"llm": 9},
        "time_s": 1,
    }
    assert list(eval_fields(ev)) == [f.name for f in EVAL_FIELDS]


def test_set_up_and_checkpoints_count_toward_no_step():
    """Step 1's ``busy_s`` was 9.2 s in a 0.44 s step: the worker's set-up (loading the weights)
    was charged to the first step's record."""
    from disagg.runtime.actor.accounting import Accounting

    acct = Accounting("llm", 0, cuda=False)
    with acct.call("setup"):
        time.sleep(0.2)
    with acct.call("zero_grad"):
        pass
    with acct.call("save_full"):
        time.sleep(0.2)
    with acct.call("loss_and_backward"):
        time.sleep(0.01)
    assert 0.01 <= acct.record.busy_s < 0.1
    assert acct.record.wait_s < 0.1  # the checkpoint is not a wait on another group either


def test_resume_summary_counts_this_invocations_steps():
    from disagg.cli.train import format_summary

    records = [
        {"step": s, "loss": 1.0, "tokens_per_s": 1.0, "skipped_samples": 0, "dropped_too_long": 0}
        for s in (7, 8, 9)
    ]
    summary = summarize(records, "runs/x")
    assert (summary["steps"], summary["steps_run"], summary["first_step"]) == (9, 3, 7)
    assert format_summary(summary).startswith("trained 3 steps (7-9, resumed at step 6)")
    fresh = summarize([{**r, "step": s} for r, s in zip(records, (1, 2, 3))], "runs/x")
    assert format_summary(fresh).startswith("trained 3 steps: ")


def test_train_log_line():
    from disagg.metrics.textlog import step_line

    line = step_line(
        {
            "step": 3,
            "loss": 2.5,
            "lr": {"vision": 1e-4, "llm": 1e-4},
            "grad_norm": 0.75,
            "tokens_per_s": 12.0,
        },
        10,
        75.0,
    )
    assert line == "step 3/10 loss 2.5000 lr 0.0001 grad_norm 0.75 tokens/s 12.0 eta 0:01:15"
    assert "lr vision=0.0001,llm=2e-05" in step_line(
        {"step": 1, "lr": {"vision": 1e-4, "llm": 2e-5}}, None, None
    )


def test_plot_draws_the_per_module_accounting(tmp_path):
    pytest.importorskip("matplotlib")
    import json

    from PIL import Image

    from disagg.metrics.plot import plot_run

    groups, records = {"llm": reduce_group(_records())}, {"llm": _records()}
    res = StepResult(2.0, 1.5, 10, 100, 4.0, groups, records, {"llm": 100})
    rows = [step_record(s, res, {}, flops={"llm": 8e9}, peak_flops=1e9) for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = plot_run(tmp_path)
    assert [p.name for p in written] == ["loss.png", "throughput.png", "memory.png", "modules.png"]
    with Image.open(tmp_path / "plots" / "modules.png") as im:
        assert im.format == "PNG" and im.size[0] > 500


def test_train_log_keeps_the_runs_warnings(tmp_path):
    import logging
    import warnings

    from disagg.metrics.textlog import TrainLog

    before = warnings.showwarning
    log = TrainLog()
    log.disagg_run_started({"train": {"steps": 2}, "output_dir": str(tmp_path)}, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a driver warning", UserWarning, stacklevel=1)
    logging.getLogger("some.library").warning("a library warning")
    logging.getLogger("some.library").info("library chatter")  # below WARNING: not the run's log
    row = {"step": 1, "loss": 2.0, "lr": {"llm": 0.1}, "grad_norm": 1.0, "step_time_s": 1.0}
    log.disagg_log_metrics(1, row)
    log.disagg_run_finished({"status": "ok", "steps": 1, "steps_run": 1})
    text = (tmp_path / "train.log").read_text()
    assert "warning UserWarning: a driver warning" in text
    assert "warning some.library: a library warning" in text and "chatter" not in text
    assert "step 1/2 loss 2.0000 lr 0.1 grad_norm 1 tokens/s ? eta 0:00:01" in text
    assert warnings.showwarning is before and log._handler not in logging.getLogger().handlers


def test_mfu_peak_per_device_and_precision():
    from disagg.metrics.peak import device_peak

    assert device_peak("cpu", "fp32", {})[0] == 20e9  # the 'cpu' planning preset, per rank
    assert device_peak("cuda", "bf16", {"GPU": 8.0, "accelerator_type:H200": 1.0})[0] == 989e12
    assert device_peak("cuda", "fp32", {"accelerator_type:A100-80G": 1.0})[0] == 19.5e12
    peak, why = device_peak("cuda", "bf16-pure", {"accelerator_type:T4": 1.0})
    assert peak is None and "T4" in why
