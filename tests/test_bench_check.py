"""``disagg bench`` checks every layout's plugins and config before its first run: a
layout naming a strategy whose plugin is not loaded, and one with an option its
strategy does not have, are both refused in one error, naming each layout, before
any layout runs (no Ray started, no run dir)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("matplotlib")

FAMILY = "qwen2_5_vl"
LAYOUTS = """
layouts:
  plain:
    vision: {strategy: ddp}
    llm:    {strategy: ddp}
  typo:
    vision: {strategy: ulysses, degree: 2, no_such_option: 1}
    llm:    {strategy: ddp}
  zero3:
    vision: {strategy: zero, stage: 3}
    llm:    {strategy: zero, stage: 3}
"""


def test_every_layout_is_checked_before_the_first_run(tmp_path: Path, monkeypatch, capsys):
    import disagg.bench.sweep as sweep
    from disagg.cli.main import main
    from disagg.cli.make_tiny import make_tiny
    from disagg.plugins import get_registry, set_registry

    make_tiny(tmp_path / "tiny", [FAMILY], train_per_class=1, eval_per_class=1)
    model = tmp_path / "tiny" / FAMILY
    data = tmp_path / "tiny" / "data"
    (tmp_path / "bench.yaml").write_text(
        f"model:\n  vision: {{family: {FAMILY}, path: {model}}}\n  llm: {{family: {FAMILY}, path: {model}}}\n"
        f"data: {{train: {data / 'train.jsonl'}, media_root: {data}}}\n"
        f"train: {{seed: 0, precision: fp32}}\noutput_dir: {tmp_path / 'run'}\n"
    )
    (tmp_path / "layouts.yaml").write_text(LAYOUTS)
    ran: list[str] = []
    monkeypatch.setattr(sweep, "run_layout", lambda resolved, *a: ran.append(resolved) or ([], None))
    monkeypatch.setenv("DISAGG_PLUGINS", "vision_sp,llm_tp")  # disagg-zero installed but not loaded
    before = get_registry()
    set_registry(None)
    try:
        t0 = time.perf_counter()
        argv = ["bench", str(tmp_path / "bench.yaml"), "--layouts", str(tmp_path / "layouts.yaml")]
        code = main([*argv, "--vision-tokens", "64", "--steps", "1", "--samples", "2", "--predict", "none"])
        took = time.perf_counter() - t0
    finally:
        set_registry(before)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "layout 'typo'" in err and "no_such_option" in err, err
    assert "layout 'zero3'" in err and "disagg-zero" in err and "not installed or not loaded" in err, err
    assert "layout 'plain'" not in err, err
    assert ran == [] and not (tmp_path / "run" / "bench" / "runs").exists()
    assert took < 60, took
