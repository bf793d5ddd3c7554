"""``disagg bench --predict --json``: the cost model's published-setting rows, machine-readable,
nothing run (no config, no Ray): every row names its layout and ``parallel`` keys, recipe, usable
fraction (0.9 unless ``--usable`` says otherwise) and offload, and carries the model's own figures
(:func:`disagg.bench.published.predict_published` and the longest-fit table)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    from disagg.cli.main import main

    code = main(["bench", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_predict_json_rows_are_the_models(capsys):
    from disagg.bench import published
    from disagg.bench.published_fit import fit_table

    code, out, err = _run(capsys, "--predict", "16k,64k", "--json", "--precision", "bf16,bf16-pure")
    assert code == 0, err
    got = json.loads(out)
    assert got["usable"] == 0.9 and got["usable_bytes_per_gpu"] == published.usable_bytes(0.9)
    for recipe in ("bf16", "bf16-pure"):
        want = published.predict_published([16384, 65536], precision=recipe, usable=0.9)
        rows = [r for r in got["rows"] if r["recipe"] == recipe]
        assert [(r["layout"], r["recompute"], r["vision_tokens"]) for r in rows] == [
            (w["layout"], w["recompute"], w["vision_tokens"]) for w in want
        ]
        for r, w in zip(rows, want):
            assert r["usable"] == 0.9 and r["offload"] == {"vision": "none", "llm": "none"}
            assert r["parallel"] == published.LAYOUTS_32B.get(r["layout"], r["parallel"])
            assert r["step_time_s"] == pytest.approx(w["step_time_s"], rel=1e-12)
            assert r["memory_per_gpu"] == w["memory_per_gpu"]
            assert r["fits"] == (r["memory_per_gpu"] <= 0.9 * 80e9)
            # a row that does not fit names what fills the GPU: its largest term is the model's
            assert (r["stops_it"] == "") == r["fits"]
            if not r["fits"]:
                sizes = {
                    f"{m} {label}": g[f"{k}_bytes"]
                    for m, g in r["groups"].items()
                    for k, label in (("state", "state"), ("activation", "activations"))
                }
                top = max(sizes, key=sizes.get)
                assert f"{top} {sizes[top] / 1e9:.1f} GB" in r["stops_it"], (r["stops_it"], sizes)
    fits = fit_table(published.usable_bytes(0.9), precisions=("bf16", "bf16-pure"))
    assert [(f["layout"], f["recipe"], f["longest_vision_tokens"]) for f in got["longest_fit"]] == [
        (f.layout, f.precision, f.longest) for f in fits
    ]
    assert all(f["usable"] == 0.9 and f["offload"] and f["parallel"] for f in got["longest_fit"])


def test_predict_json_usable_and_errors(capsys):
    code, out, err = _run(capsys, "--predict", "16k", "--json", "--usable", "1.0")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert rows and all(r["usable"] == 1.0 and r["fits"] == (r["memory_per_gpu"] <= 80e9) for r in rows)
    code, _, err = _run(capsys, "--predict", "16k", "--json", "--precision", "fp8")
    assert code == 2 and "--precision" in err and "bf16-pure" in err, err
    code, _, err = _run(capsys, "--predict", "16k")  # runs layouts: needs a config
    assert code == 2 and "config" in err, err


def test_predict_json_stdout_is_json_alone_in_a_fresh_process(tmp_path):
    """In a fresh process DeepSpeed (imported by the ``zero`` estimate) logs to stdout when first
    imported: the answer must still be the only thing there (``... --json | jq``)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("disagg_zero")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # DeepSpeed's own detection
    cmd = [sys.executable, "-m", "disagg.cli.main", "bench", "--predict", "16k", "--json"]
    cmd += ["--precision", "bf16"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)  # fails on any line printed before the answer
    assert rows
