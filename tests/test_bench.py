"""``disagg bench`` on the tiny Qwen2.5-VL: a tiny sweep (2 layouts, 2 vision
lengths, 2 steps) leaves a complete, self-consistent bench.json, bench.md and
plots, the vision group's measured bytes equal the analytic count where the
model is exact, and both groups' collective calls equal the planner's count.
A benchmark, not a timed test: no speed is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("matplotlib")

FAMILY = "qwen2_5_vl"
LENGTHS = [64, 256]  # patches per image: whole 16-patch windows, an even split over 2 ranks
LAYOUTS = """
layouts:
  uniform_tp:
    vision: {strategy: megatron_tp, degree: 2}
    llm:    {strategy: megatron_tp, degree: 2}
  dhp_ulysses_tp:
    vision: {strategy: ulysses, degree: 2}
    llm:    {strategy: megatron_tp, degree: 2}
"""


@pytest.fixture(scope="module")
def bench(ray_local, tmp_path_factory) -> Path:
    from disagg.cli.main import main
    from disagg.cli.make_tiny import make_tiny

    root = tmp_path_factory.mktemp("bench")
    tiny = make_tiny(root / "tiny", [FAMILY], train_per_class=1, eval_per_class=1)
    model = tiny[FAMILY] if isinstance(tiny, dict) and FAMILY in tiny else root / "tiny" / FAMILY
    (root / "bench.yaml").write_text(
        f"model:\n  vision: {{family: {FAMILY}, path: {model}}}\n  llm: {{family: {FAMILY}, path: {model}}}\n"
        f"data: {{train: {root / 'tiny' / 'data' / 'train.jsonl'}, media_root: {root / 'tiny' / 'data'}}}\n"
        f"train: {{seed: 0, lr: 1.0e-3}}\noutput_dir: {root / 'run'}\n"
    )
    (root / "layouts.yaml").write_text(LAYOUTS)
    argv = ["bench", str(root / "bench.yaml"), "--layouts", str(root / "layouts.yaml")]
    argv += ["--vision-tokens", ",".join(map(str, LENGTHS)), "--steps", "2", "--samples", "2"]
    argv += ["--predict", "4k,64k"]  # the budget search is tested without Ray (test_bench_budget.py)
    assert main(argv) == 0
    return root / "run" / "bench"


def test_outputs_are_complete(bench: Path):
    result = json.loads((bench / "bench.json").read_text())
    assert result["config"]["precision"] == "fp32" and result["config"]["vision_tokens"] == LENGTHS
    points = {(p["layout"], p["vision_tokens"]): p for p in result["points"]}
    assert set(points) == {(name, n) for name in ("uniform_tp", "dhp_ulysses_tp") for n in LENGTHS}
    for p in points.values():
        assert "error" not in p, p.get("error")
        m = p["measured"]
        assert m["steps"] == 2 and m["tokens_per_s"] > 0
        assert set(m["groups"]) == {"vision", "llm"}
        for g in m["groups"].values():
            for key in ("busy_s", "comm_bytes_per_rank", "state_bytes_per_rank", "activation_bytes_per_rank"):
                assert g[key] > 0, key
        # collocated groups add up: the memory figure is the groups' state + saved activations
        total = sum(g["state_bytes_per_rank"] + g["activation_bytes_per_rank"] for g in m["groups"].values())
        assert p["memory_per_rank"]["measured"] == total
    # the same data for every layout: same tokens per step at each length
    for n in LENGTHS:
        assert (
            points[("uniform_tp", n)]["measured"]["tokens_per_step"]
            == points[("dhp_ulysses_tp", n)]["measured"]["tokens_per_step"]
        )
    md = (bench / "bench.md").read_text()
    assert md.count("| uniform_tp |") >= len(LENGTHS) and md.count("| dhp_ulysses_tp |") >= len(LENGTHS)
    assert "Qwen2.5-VL-32B" in md and "1.26" in md
    for png in ("throughput.png", "memory.png"):
        assert (bench / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {r["vision_tokens"] for r in result["published_prediction"]["rows"]} == {4096, 65536}


def test_measured_bytes_equal_the_analytic_count(bench: Path):
    result = json.loads((bench / "bench.json").read_text())
    for p in result["points"]:
        # collective calls, by kind, in both groups: what the planner's latency terms count
        for m in ("vision", "llm"):
            got_calls = p["measured"]["groups"][m]["collective_calls_per_rank"]
            assert got_calls and got_calls == p["predicted"]["groups"][m]["comm_calls_by_kind"], (
                p["layout"],
                m,
            )
        got = p["measured"]["groups"]["vision"]
        want = p["predicted"]["groups"]["vision"]
        where = f"{p['layout']} @ {p['vision_tokens']}"
        assert "comm_bytes" in want["exact"] and "state_bytes" in want["exact"], where
        assert got["comm_bytes_per_rank"] == want["comm_bytes"], where
        if got.get("collective_bytes_per_rank") is not None:  # by kind, where the metrics carry it
            assert got["collective_bytes_per_rank"] == want["comm_bytes_by_kind"], where
            assert got["sent_bytes_per_rank"] == want["sent_bytes"], where
        assert got["state_bytes_per_rank"] == want["state_bytes"], where
        # fp32 saved activations of the tower: exact under ulysses, an estimate under TP
        rel = 0 if p["layout"] == "dhp_ulysses_tp" else 0.05
        assert got["activation_bytes_per_rank"] == pytest.approx(want["activation_bytes"], rel=rel), where
    for row in result["targets"]["per_length"]:
        ratio = row["vision_bytes_ulysses_vs_tp"]
        assert ratio["measured"] == pytest.approx(ratio["analytic"], rel=1e-12)


def test_predicted_over_measured_comes_from_the_run(bench: Path):
    """Each point's predicted ÷ measured: the measured side read back from the layout's own
    ``metrics.jsonl`` (medians of the timed steps, the last step's bytes and calls, the run's
    per-group ``flops``), the predicted side the planner's model of the run's own resolved config
    (``disagg.plan.own``) on the ``cpu`` time model, and the machine's load recorded beside them."""
    import os
    import statistics

    import yaml

    from disagg.config.schema import Config
    from disagg.metrics.flops import sample_flops
    from disagg.plan.cluster import PRESETS
    from disagg.plan.model import Workload
    from disagg.plan.own import own_layout
    from disagg.plan.workload import config_shapes
    from disagg.plugins import get_registry

    result = json.loads((bench / "bench.json").read_text())
    host = result["machine"]
    assert host["cores"] == os.cpu_count()
    for key in ("load_start", "load_end"):
        assert len(host[key]["loadavg_1_5_15"]) == 3 and host[key]["cores"] == os.cpu_count()
    assert result["time_model"]["name"] == "cpu"
    rows = {(r["layout"], r["vision_tokens"]): r for r in result["predicted_vs_measured"]}
    assert set(rows) == {(p["layout"], p["vision_tokens"]) for p in result["points"]}
    assert json.loads((bench / "versus.json").read_text())["rows"] == result["predicted_vs_measured"]
    md = (bench / "versus.md").read_text()
    assert md.count("| uniform_tp |") == len(LENGTHS) and "load" in md
    for name in ("uniform_tp", "dhp_ulysses_tp"):
        run = bench / "runs" / f"{name}-{'-'.join(map(str, LENGTHS))}"
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        assert len(records) == 2 * len(LENGTHS)
        cfg = Config.model_validate(yaml.safe_load((run / "config.yaml").read_text()))
        shapes = config_shapes(cfg)
        for k, n in enumerate(LENGTHS):
            mine, row = records[2 * k : 2 * k + 2], rows[(name, n)]
            timed, last = mine[1:], mine[-1]
            want_time = statistics.median(r["step_time_s"] for r in timed)
            assert row["step_time_s"]["measured"] == want_time
            rows_per_sample = n // shapes["vision"].unit
            work = Workload(
                shapes=shapes,
                vision_tokens=n,
                text_tokens=last["tokens"] // 2 - rows_per_sample,
                samples=2,
                precision="fp32",
                max_inflight=cfg.train.max_inflight,
            )
            own = own_layout(cfg, work, PRESETS["cpu"], get_registry().strategies)
            assert own.layout is not None, own.why
            assert row["step_time_s"]["predicted"] == pytest.approx(own.layout.step_time_s, rel=1e-12)
            assert row["step_time_s"]["ratio"] == pytest.approx(own.layout.step_time_s / want_time, rel=1e-12)
            assert row["load_after"]["cores"] == os.cpu_count()
            for m in ("vision", "llm"):
                g = row["groups"][m]
                assert g["comm_bytes_per_rank"]["measured"] == last["comm_bytes_per_rank"][m]
                calls = sum(last["collective_calls_per_rank"][m].values())
                assert g["collective_calls_per_rank"]["measured"] == calls > 0
                # the planner states every call the ranks make (test_measured_bytes_equal_...)
                assert g["collective_calls_per_rank"]["ratio"] == 1.0
                flops = statistics.median(r["flops"][m] for r in timed)
                assert g["flops"]["measured"] == flops > 0
                # predicted: the cost hooks' count of the nominal sample (sample_flops), 2 samples
                seq = n if m == "vision" else last["tokens"] // 2
                assert g["flops"]["predicted"] == pytest.approx(2 * sample_flops(shapes[m], seq), rel=1e-9)
                # the nominal sample (every image the same size, one length of text) is the run's
                assert g["flops"]["ratio"] == pytest.approx(1.0, rel=0.02), (name, n, m, g["flops"])
                for q in g.values():
                    assert q["ratio"] == pytest.approx(q["predicted"] / q["measured"], rel=1e-12)
