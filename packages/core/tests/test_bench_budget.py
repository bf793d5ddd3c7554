"""The budget search of ``disagg bench`` and its small parsers, without Ray: runs
are replaced by a memory curve (the search only sees measured points)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from disagg.bench.data import grid_for, parse_tokens, snap_length
from disagg.bench.sweep import Bench
from disagg.cli.bench import parse_bytes
from disagg.config.schema import Config

VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=4,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=16,
    fullatt_block_indexes=[1],
    out_hidden_size=48,
)
TEXT = dict(
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
)
LAYOUTS = {
    "dhp": {"vision": {"strategy": "ulysses", "degree": 2}, "llm": {"strategy": "megatron_tp", "degree": 2}},
    "zero3": {
        "vision": {"strategy": "zero", "stage": 3, "replicas": 2},
        "llm": {"strategy": "zero", "stage": 3, "replicas": 2},
    },
}
#: bytes per vision token per rank in the fake runs: ZeRO-3 holds whole images, DHP halves
PER_TOKEN = {"dhp": 500, "zero3": 1000}
BUDGET = 1_000_000


class FakeBench(Bench):
    runs: list[tuple[str, list[int]]]

    def run(
        self, name: str, lengths: list[int], steps: int | None = None, tag: str = ""
    ) -> list[dict[str, Any]]:
        self.runs.append((name, list(lengths)))
        out = []
        for n in lengths:
            mem = PER_TOKEN[name] * n
            out.append(
                {
                    "layout": name,
                    "vision_tokens": n,
                    "measured": {"tokens_per_step": 2 * (n // 4 + 20)},
                    "memory_per_rank": {"measured": mem},
                    "fits_budget": mem <= BUDGET,
                }
            )
        return out


def make(tmp_path: Path, lengths: list[int]) -> FakeBench:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vision_config": VISION, "text_config": TEXT}))
    base = Config.model_validate(
        {
            "model": {
                "vision": {"family": "qwen2_5_vl", "path": str(model)},
                "llm": {"family": "qwen2_5_vl", "path": str(model)},
            },
            "output_dir": str(tmp_path / "out"),
        }
    )
    b = FakeBench(base, LAYOUTS, lengths, 2, 2, "fp32", tmp_path / "out", registry=None, budget=BUDGET)  # type: ignore[arg-type]
    b.runs = []
    return b


def test_search_brackets_the_limit_with_real_points(tmp_path: Path):
    b = make(tmp_path, [256, 4096])
    b.sweep()
    for name in LAYOUTS:
        found = b.largest_under_budget(name)
        limit = BUDGET // PER_TOKEN[name]
        assert found["largest_fitting"] <= limit < (found["smallest_over"] or 10**9)
        # two rounds of three probes narrow 256..4096 to within a few windows of the true limit
        assert found["largest_fitting"] >= 0.85 * limit, found
        assert all(p["layout"] == name for p in found["probes"])
    dhp, z3 = (b.largest_under_budget(n)["largest_fitting"] for n in ("dhp", "zero3"))
    assert dhp >= 0.85 * 2 * z3


def test_search_stops_at_the_cap(tmp_path: Path):
    b = make(tmp_path, [64, 128])
    b.max_vision_tokens = 256
    b.sweep()
    found = b.largest_under_budget("dhp")  # 256 tokens fit: the search may not go past the cap
    assert found["largest_fitting"] == 256 and found["capped_at"] == 256
    assert max(n for _, ns in b.runs for n in ns) <= 256


def test_parsers():
    assert parse_tokens("1k, 4k,256") == [256, 1024, 4096]
    assert (
        parse_bytes("64MiB") == 64 * 2**20 and parse_bytes("2G") == 2 * 2**30 and parse_bytes("1000") == 1000
    )
    assert grid_for(1024, 4, 2) == (32, 32) and grid_for(48, 4, 2) == (4, 12)
    with pytest.raises(ValueError, match="multiple of 16"):
        grid_for(40, 4, 2)
    with pytest.raises(ValueError, match="not a number"):
        parse_tokens("lots")


def test_lengths_are_photo_like_grids():
    # 3376 = 211 windows of 4x4 (prime): only a 4x844 strip, which Qwen2-VL's
    # image processor refuses (aspect >= 200); the search probed it once
    with pytest.raises(ValueError, match=r"4x844 grid.*use e.g. 3360 or 3456"):
        grid_for(3376, 4, 2)
    assert snap_length(3376, 4, 2) == 3360 and grid_for(3360, 4, 2) == (56, 60)
    assert snap_length(3376, 4, 2, below=False) == 3456
    for n in range(16, 20000, 16):  # every snapped length is a grid of whole windows, at most 4:1
        rows, cols = grid_for(snap_length(n, 4, 2), 4, 2)
        assert rows % 4 == cols % 4 == 0 and cols <= 4 * rows and rows * cols <= max(n, 16)


def test_targets_judge_the_best_dhp_variant_against_zero3():
    from disagg.bench.report import targets, targets_md

    search = {
        "uniform_tp": {"largest_fitting": 1664},
        "dhp_ulysses_tp": {"largest_fitting": 3072},
        "dhp_ulysses_tp_sp": {"largest_fitting": 3584},
        "uniform_zero3": {"largest_fitting": 1024},
    }
    t = targets([], 4, search)
    x = t["largest_dhp_vs_zero3"]
    assert x["layout"] == "dhp_ulysses_tp_sp" and x["measured"] == 3.5 and x["target_at_least"] == 3.4
    assert x["per_layout"] == {"dhp_ulysses_tp": 3.0, "dhp_ulysses_tp_sp": 3.5}
    md = targets_md(t)
    assert "dhp_ulysses_tp 3.00" in md and "best dhp_ulysses_tp_sp 3.50 (target ≥ 3.40)" in md
    # no ZeRO-3 limit: no ratio, rather than a division by nothing
    assert "largest_dhp_vs_zero3" not in targets([], 4, {**search, "uniform_zero3": {"largest_fitting": 0}})
    assert "largest_dhp_vs_zero3_recompute" not in t  # no ZeRO-3 with recompute in the search


def test_targets_judge_dhp_with_recompute_against_zero3_with_recompute():
    from disagg.bench.report import targets, targets_md

    search = {
        "dhp_ulysses_tp_sp": {"largest_fitting": 2816},
        "dhp_ulysses_tp_sp_recompute": {"largest_fitting": 6336},
        "uniform_zero3": {"largest_fitting": 1024},
        "uniform_zero3_recompute": {"largest_fitting": 2112},
    }
    t = targets([], 2, search)
    assert t["largest_dhp_vs_zero3"]["measured"] == 6336 / 1024  # the preset's ZeRO-3
    # only the DHP layouts that recompute, against the ZeRO-3 that does
    assert t["largest_dhp_vs_zero3_recompute"] == {"dhp_ulysses_tp_sp_recompute": 3.0}
    # ZeRO-3's own recompute gain is reported, without DHP's target
    assert "target_at_least" not in t["recompute_vs_none"]["uniform_zero3_recompute"]
    assert "uniform_zero3_recompute ÷ uniform_zero3: longest fitting vision sequence 2.06×;" in targets_md(t)
    assert "DHP with recompute ÷ ZeRO-3 with recompute: dhp_ulysses_tp_sp_recompute 3.00." in targets_md(t)


def test_targets_report_recompute_against_its_base_layout():
    from disagg.bench.report import targets, targets_md

    search = {
        "dhp_ulysses_tp_sp": {"largest_fitting": 2816},
        "dhp_ulysses_tp_sp_recompute": {"largest_fitting": 8448},
        "uniform_zero3": {"largest_fitting": 1408},
    }

    def point(name: str, n: int, tps: float) -> dict:
        return {"layout": name, "vision_tokens": n, "measured": {"tokens_per_s": tps, "groups": {}}}

    points = [point("dhp_ulysses_tp_sp", 256, 100.0), point("dhp_ulysses_tp_sp_recompute", 256, 80.0)]
    t = targets(points, 2, search)
    x = t["recompute_vs_none"]["dhp_ulysses_tp_sp_recompute"]
    assert x["baseline"] == "dhp_ulysses_tp_sp" and x["largest"] == 3.0 and x["target_at_least"] == 3.0
    assert x["throughput"] == {256: 0.8}
    md = targets_md(t)
    assert "dhp_ulysses_tp_sp_recompute ÷ dhp_ulysses_tp_sp: longest fitting vision sequence 3.00×" in md
    assert "256: 0.80" in md


def test_each_layouts_points_are_kept_as_it_finishes(tmp_path: Path):
    """A bench that stops in its second layout (a crash, Ctrl-C) keeps the first one's points."""
    b = make(tmp_path, [256, 512])
    first = b.run

    def run(name: str, lengths: list[int], steps: int | None = None, tag: str = "") -> list[dict[str, Any]]:
        if name == "zero3":
            kept = [json.loads(x) for x in (b.out_dir / "points.jsonl").read_text().splitlines()]
            assert [(p["layout"], p["vision_tokens"]) for p in kept] == [("dhp", 256), ("dhp", 512)]
            raise KeyboardInterrupt
        return first(name, lengths, steps, tag)

    b.run = run  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        b.sweep()
    kept = [json.loads(x) for x in (b.out_dir / "points.jsonl").read_text().splitlines()]
    assert [p["layout"] for p in kept] == ["dhp", "dhp"]
    b.run = first  # type: ignore[method-assign]
    b.sweep()  # a new sweep starts its file afresh
    kept = [json.loads(x) for x in (b.out_dir / "points.jsonl").read_text().splitlines()]
    assert [p["layout"] for p in kept] == ["dhp", "dhp", "zero3", "zero3"]
