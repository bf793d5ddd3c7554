"""Bench layouts: the d a file of layouts is judged by, and ZeRO-3 partitioning the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.bench.presets import largest_group, load_layouts, paper
from disagg.config.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "bench"


@pytest.mark.parametrize(
    "path,d", [(EXAMPLES / "layouts.yaml", 2), (EXAMPLES / "results" / "layouts_d4.yaml", 4)]
)
def test_a_layouts_file_is_judged_by_its_largest_group(path: Path, d: int) -> None:
    layouts = load_layouts(path, ["vision", "llm"])
    assert largest_group(layouts) == d
    # the preset at that degree is what the file writes out (plus its own extras)
    for name, parallel in paper(d, ["vision", "llm"]).items():
        if name in layouts:
            for module, group in layouts[name].items():
                assert {k: v for k, v in parallel[module].items() if k in group} == group, (name, module)


def test_zero3_partitions_every_tensor_of_a_tiny_model() -> None:
    z3 = paper(4, ["vision", "llm"])["uniform_zero3"]
    for group in z3.values():
        assert group["replicas"] == 4
        assert group["ds_config"]["zero_optimization"]["stage3_param_persistence_threshold"] == 0


def test_a_layout_naming_an_unknown_module_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "layouts.yaml"
    bad.write_text("layouts:\n  x:\n    audio: {strategy: ddp}\n")
    with pytest.raises(ConfigError, match="layouts.x.audio"):
        load_layouts(bad, ["vision", "llm"])
