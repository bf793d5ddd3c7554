"""``disagg data check``: every problem of a dataset up front, with file and line, and lengths."""

from __future__ import annotations

import json

import pytest
import ray
import test_data_fakes
import yaml
from test_data_fakes import caption_sample, make_tokenizer_dir, write_image, write_jsonl

import disagg

ray.cloudpickle.register_pickle_by_value(test_data_fakes)  # Ray workers cannot import test modules


class FakesPlugin:
    @disagg.hookimpl
    def disagg_register_families(self, register):
        register(test_data_fakes.FakeImageFamily)
        register(test_data_fakes.FakeLMFamily)


def test_check_reports_every_problem_and_lengths(tmp_path, ray_local, disagg_registry, capsys):
    from disagg.cli.main import main
    from disagg.plugins import register_plugin

    register_plugin(FakesPlugin(), name="fakes")
    make_tokenizer_dir(tmp_path)
    write_image(tmp_path / "a.png", 8, 8)
    write_image(tmp_path / "big.png", 16, 16)
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 4)
    rows = [caption_sample("a.png", f"A red square {i}.") for i in range(20)]
    rows[3] = caption_sample("big.png", "A big one.")
    rows[12] = caption_sample("corrupt.png", "Broken.")
    rows[17] = caption_sample("missing.png", "Gone.")
    data = write_jsonl(tmp_path / "d.jsonl", rows + ['{"conversations": ['])
    cfg = {
        "model": {
            "vision": {"family": "fake_image", "path": str(tmp_path / "tok")},
            "llm": {"family": "fake_lm", "path": str(tmp_path / "tok")},
        },
        "data": {"train": str(data), "media_root": str(tmp_path), "batch_size": 2},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "report.json"
    rc = main(["data", "check", str(tmp_path / "c.yaml"), "--no-progress", "--report", str(out)])
    assert rc == 1
    report = json.loads(out.read_text())
    assert (report["samples"], report["ok"], report["bad"], report["too_long"]) == (21, 18, 3, 0)
    # in file order, each with its line
    assert [p.split(": ")[0] for p in report["problems"]] == [f"{data}:{n}" for n in (13, 18, 21)]
    assert "cannot decode image" in report["problems"][0] and "missing image" in report["problems"][1]
    assert report["media_tokens"]["vision"] == {
        "samples": 18,
        "min": 4,
        "mean": (17 * 4 + 16) / 18,
        "max": 16,
    }
    assert "ok: 18, bad: 3" in capsys.readouterr().out

    # a clean dataset exits 0; max_tokens shows up as too long
    write_jsonl(data, rows[:3])
    out.unlink()
    assert main(["data", "check", str(tmp_path / "c.yaml"), "--no-progress", "--report", str(out)]) == 0
    rc = main(["data", "check", str(tmp_path / "c.yaml"), "--no-progress", "--set", "data.max_tokens=5"])
    assert rc == 1 and "too long (data.max_tokens): 3" in capsys.readouterr().out

    # truncate: what it cuts is counted and the lengths are the cut ones; a cut through the
    # image placeholders is a problem of its sample
    shortest = json.loads(out.read_text())["tokens"]["min"]
    args = ["data", "check", str(tmp_path / "c.yaml"), "--no-progress", "--report", str(out)]
    truncate = ["--set", "data.on_too_long=truncate", "--set"]
    assert main([*args, *truncate, f"data.max_tokens={shortest - 1}"]) == 0
    report = json.loads(out.read_text())
    assert (report["ok"], report["truncated"], report["tokens"]["max"]) == (3, 3, shortest - 1)
    assert main([*args, *truncate, "data.max_tokens=5"]) == 1
    report = json.loads(out.read_text())
    assert (report["ok"], report["bad"]) == (0, 3)
    assert all("would cut vision placeholder tokens" in p for p in report["problems"])


@pytest.mark.parametrize("argv", [["data"], ["data", "check"]])
def test_check_usage_errors(argv):
    from disagg.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
