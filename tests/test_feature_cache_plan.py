"""The planner and ``parallel: auto`` with a frozen, cached tower (``parallel.vision.feature_cache``).

The cost model (:mod:`disagg.plan.feature_cache`): the expected cost per step over the run's ``E``
epochs: the tower encodes in epoch 1 only, so its work is charged ``x 1/E``; its rows still reach
the LLM and its memory is epoch 1's. No Ray: plans only, on the tiny Qwen2.5-VL."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

FAMILY = "qwen2_5_vl"
#: a heavy tower (16k patches per image) beside the tiny LLM, on 4 CPU devices
PATCHES, TEXT, BATCH = 16384, 32, 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from disagg.cli.make_tiny import make_tiny

    root = tmp_path_factory.mktemp("plan")
    make_tiny(root / "tiny", [FAMILY], train_per_class=1, eval_per_class=1)
    return root


def _config(root: Path, steps: int, vision: dict, **parallel) -> dict:
    model = {"family": FAMILY, "path": str(root / "tiny" / FAMILY)}
    data = root / "tiny" / "data"
    return {
        "model": {"vision": model, "llm": model},
        "parallel": {"vision": vision, **parallel},
        "data": {"train": str(data / "train.jsonl"), "media_root": str(data), "batch_size": BATCH},
        "train": {"seed": 0, "steps": steps, "modules": {"vision": {"freeze": True}}},
        "output_dir": str(root / "run"),
    }


def _samples(root: Path) -> int:
    return len((root / "tiny" / "data" / "train.jsonl").read_text().splitlines())


def _plan(root: Path, steps: int, cache: str):
    from disagg.config.schema import Config
    from disagg.plan.cluster import cluster_from
    from disagg.plan.search import plan
    from disagg.plan.workload import config_families, config_workload
    from disagg.plugins import get_registry

    reg = get_registry()
    cfg = Config.model_validate(_config(root, steps, {"feature_cache": cache}))
    work = config_workload(cfg, vision_patches=PATCHES, text_tokens=TEXT, registry=reg)
    cluster = cluster_from("cpu", {"gpus": 4})
    return work, plan(work, cluster, reg.strategies, config_families(cfg, reg), ("disaggregated",))


def _tower_ranks(layout) -> int:
    return layout.groups["vision"].ranks


def test_a_cached_frozen_tower_is_charged_its_first_epoch_only(tiny: Path):
    epochs = 10
    steps = epochs * _samples(tiny) // BATCH
    work, cached = _plan(tiny, steps, "host")
    assert work.encoded == {"vision": pytest.approx(1 / epochs)}
    plain_work, plain = _plan(tiny, steps, "none")
    assert plain_work.encoded == {}
    # the plan with the cache is faster and gives the tower no more devices
    assert cached.best.step_time_s < plain.best.step_time_s
    assert _tower_ranks(cached.best) <= _tower_ranks(plain.best)
    # layout by layout: the tower's compute, collectives and launches x 1/E, its transfer to
    # the LLM and its memory as before, the LLM untouched
    by_name = {x.name(): x for x in plain.ranked + plain.oom}
    for x in cached.ranked[:5]:
        ref = by_name[x.name()]
        v, w = x.times["vision"], ref.times["vision"]
        assert v["compute_s"] == pytest.approx(w["compute_s"] / epochs)
        assert v["collective_s"] == pytest.approx(w["collective_s"] / epochs)
        assert v["transfer_s"] == w["transfer_s"] and v["overhead_s"] < w["overhead_s"]
        assert x.times["llm"] == ref.times["llm"] and x.memory_bytes == ref.memory_bytes
        assert x.step_time_s < ref.step_time_s


def test_a_run_of_one_epoch_gains_nothing_from_the_cache(tiny: Path):
    steps = _samples(tiny) // BATCH  # epoch 1 only: every sample encoded once
    _, cached = _plan(tiny, steps, "disk")
    _, plain = _plan(tiny, steps, "none")
    assert [(x.name(), x.step_time_s) for x in cached.ranked] == [
        (x.name(), x.step_time_s) for x in plain.ranked
    ]


def test_parallel_auto_keeps_the_feature_cache_keys(tiny: Path):
    """``parallel: auto`` replaces the groups with the plan's, the user's cache keys stay."""
    from disagg.config.schema import Config
    from disagg.config.validate import validate
    from disagg.plan.auto import resolve_auto
    from disagg.plugins import get_registry

    cache = {
        "feature_cache": "disk",
        "feature_cache_dir": str(tiny / "features"),
        "feature_cache_ahead": 1,
        "feature_cache_gb": 2.0,
    }
    auto = {"cluster": "cpu", "vision_tokens": 64, "text_tokens": TEXT, "placement": "disaggregated"}
    cfg = Config.model_validate(_config(tiny, 60, cache, auto=auto))
    resolved, record = resolve_auto(cfg, get_registry())
    vision = resolved.parallel.vision
    assert {k: getattr(vision, k) for k in cache} == cache
    assert vision.strategy == record["chosen"]["parallel"]["vision"]["strategy"]
    assert resolved.parallel.llm.feature_cache == "none"
    validate(resolved, get_registry())


def test_bench_predicts_the_epoch_2_ratio_of_the_configs_own_layout(tiny: Path, tmp_path: Path):
    """``disagg bench --feature-cache``'s prediction: the config's own layout, the data's mean
    sample, every tower output cached ÷ none cached; the tower's work is all that goes."""
    from disagg.bench.feature_cache import cache_config, data_tokens, predicted
    from disagg.config.schema import Config
    from disagg.plugins import get_registry

    reg = get_registry()
    base = Config.model_validate(_config(tiny, 1, {"strategy": "ddp"}, llm={"strategy": "ddp"}))
    cfg = cache_config(base, "host", tmp_path, 6)
    assert cfg.parallel.vision.feature_cache == "host" and cfg.train.modules["vision"].freeze is True
    rows, text = data_tokens(cfg, reg)
    assert rows > 0 and text > 0
    got = predicted(cfg, reg)
    assert (got["vision_tokens"], got["text_tokens"]) == (rows, text)
    assert 0 < got["ratio"] < 1
    assert got["step_time_s"]["cached"] == pytest.approx(got["ratio"] * got["step_time_s"]["uncached"])
