"""``disagg plan`` and ``parallel: auto`` offer ``parallel.<module>.mlp_tiles: auto`` in a fallback
pass (:func:`disagg.plan.search.plan`'s ``tiles``): only when no layout fits without it.

A Qwen2.5-VL config (the tiny model's, 256 wide, MLPs 32 (LLM) and 16 (vision) times wider) at a
million text tokens on one H100: every untiled layout needs over 150 GiB (one block's MLP
intermediates, even with full recompute and everything offloaded); with the LLM tiled the best needs 39 GiB.
Config values and cost hooks only: no weights, no actor, no Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("disagg_llm_tp")

#: the tiny Qwen2.5-VL's config (``disagg make-tiny``), the LLM widened
CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "dtype": "float32",
    "image_token_id": 5,
    "model_type": "qwen2_5_vl",
    "text_config": {
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 256,
        "intermediate_size": 8192,
        "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": 4096,
        "model_type": "qwen2_5_vl_text",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"mrope_section": [2, 2, 2], "rope_theta": 10000.0, "rope_type": "default"},
        "vocab_size": 391,
    },
    "tie_word_embeddings": False,
    "video_token_id": 6,
    "vision_end_token_id": 4,
    "vision_start_token_id": 3,
    "vision_config": {
        "depth": 4,
        "fullatt_block_indexes": [1, 3],
        "hidden_act": "silu",
        "hidden_size": 256,
        "in_channels": 3,
        "intermediate_size": 4096,
        "model_type": "qwen2_5_vl_vision",
        "num_heads": 4,
        "out_hidden_size": 256,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "tokens_per_second": 4,
        "window_size": 16,
    },
}
LONG, SHORT, PATCHES = "1000000", "128", "16384"


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plantiles")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(CONFIG))
    (root / "train.jsonl").write_text("")
    doc = {
        "model": {m: {"family": "qwen2_5_vl", "path": str(root / "model")} for m in ("vision", "llm")},
        "data": {"train": str(root / "train.jsonl"), "media_root": str(root), "batch_size": 1},
        "train": {"seed": 0, "lr": 1.0e-3, "steps": 2},
        "output_dir": str(root / "run"),
    }
    (root / "cfg.yaml").write_text(yaml.safe_dump(doc))
    return root / "cfg.yaml"


def _argv(cfg: Path, tokens: str, strategies: str, *extra: str) -> list[str]:
    return [
        "plan",
        str(cfg),
        "--cluster",
        "h100x8",
        "--gpus",
        "1",
        "--text-tokens",
        tokens,
        "--vision-patches",
        PATCHES,
        "--samples",
        "1",
        "--placement",
        "collocated",
        "--strategies",
        strategies,
        *extra,
    ]


def _tiled(x) -> list[str]:  # type: ignore[no-untyped-def]
    return [m for m, g in x.groups.items() if dict(g.options).get("mlp_tiles", 1) != 1]


def test_out_of_memory_without_tiles_plans_tiles(cfg: Path, capsys):
    """Nothing fits untiled: the fallback pass picks ``mlp_tiles: auto`` for the LLM, says why, and
    writes a layout validation accepts; every tiled layout kept has no untiled twin that fits."""
    from disagg.cli.main import main
    from disagg.config.load import load_config
    from disagg.config.validate import validate
    from disagg.plugins import get_registry

    out = cfg.parent / "plan.yaml"
    js = cfg.parent / "plan.json"
    assert main(_argv(cfg, LONG, "ddp,zero", "--write", str(out), "--json", str(js))) == 0
    text = capsys.readouterr().out
    assert "nothing fits without tiles: mlp_tiles: auto offered" in text
    assert (
        "llm: mlp_tiles=auto" in text.split("uses ")[1]
        and "mlp_tiles wins on memory: nothing without it fits" in text
    )
    written = yaml.safe_load(out.read_text())
    llm = written["parallel"]["llm"]
    assert llm["mlp_tiles"] == "auto" and llm["strategy"] == "ddp", llm
    doc = json.loads(js.read_text())
    assert doc["ranked"] and all("mlp_tiles=auto" in r["name"] for r in doc["ranked"])
    # zero refuses tiles (validation): never offered to it
    assert not [r for r in doc["ranked"] + doc["oom"] if "zero(1x1,mlp_tiles" in r["name"]]
    # the written layout passes validation
    merged = yaml.safe_load(cfg.read_text())
    merged["parallel"], merged["train"] = written["parallel"], {**merged["train"], **written["train"]}
    (cfg.parent / "merged.yaml").write_text(yaml.safe_dump(merged))
    resolved = validate(load_config(cfg.parent / "merged.yaml"), get_registry())
    assert resolved.modules["llm"].options.mlp_tiles == "auto"


def test_fits_without_tiles_is_one_unchanged_pass(cfg: Path):
    """A short sequence fits untiled: the plan with the fallback is the plan without it (the same
    layouts, figures and order), no tiles anywhere."""
    got = [_plan(cfg, SHORT, ("ddp", "zero"), prune=True, tiles=t) for t in (False, True)]
    assert got[1].ranked and not got[1].tiled
    for a, b in zip(got[0].ranked + got[0].oom, got[1].ranked + got[1].oom, strict=True):
        assert (a.name(), a.step_time_s, a.memory_bytes) == (b.name(), b.step_time_s, b.memory_bytes)
    assert not [x for x in got[1].ranked + got[1].oom if _tiled(x)]


def _plan(cfg: Path, tokens: str, names: tuple[str, ...], families=None, **kw):  # type: ignore[no-untyped-def]
    from disagg.config.load import load_config
    from disagg.plan.cluster import cluster_from
    from disagg.plan.search import plan
    from disagg.plan.workload import config_families, config_workload
    from disagg.plugins import get_registry

    reg = get_registry()
    c = load_config(cfg)
    strategies = {n: reg.strategies[n] for n in names}
    work = config_workload(c, registry=reg, text_tokens=int(tokens), vision_patches=int(PATCHES), samples=1)
    cluster = cluster_from("h100x8", {"gpus": 1})
    fams = config_families(c, reg)
    return plan(work, cluster, strategies, families(fams) if families else fams, ("collocated",), **kw)


def test_a_family_without_declared_mlps_is_offered_no_tiles(cfg: Path):
    """The planner asks validation's question (:func:`tiled_mlp.family_problems`): with the LLM's
    family declaring no MLP modules, or its ``layer_map`` raising, no ``mlp_tiles`` is offered for
    it (validation would refuse that layout), so the fallback pass still finds nothing that fits."""
    import dataclasses

    def no_mlps(fams):  # type: ignore[no-untyped-def]
        llm = fams["llm"]
        lmap = dataclasses.replace(llm.layer_map(), mlp={})
        llm.layer_map = lambda: lmap  # the instance only: its class is the registered family
        return fams

    def raising(fams):  # type: ignore[no-untyped-def]
        def fail():  # type: ignore[no-untyped-def]
            raise ValueError("no layer map")

        fams["llm"].layer_map = fail
        return fams

    assert _tiled(_plan(cfg, LONG, ("ddp",), prune=True, tiles=True).best) == ["llm"]  # the control
    for families in (no_mlps, raising):
        result = _plan(cfg, LONG, ("ddp",), families=families, prune=True, tiles=True)
        assert result.tiled and not result.ranked, families.__name__
        assert not [x for x in result.oom if "llm" in _tiled(x)], families.__name__


def test_no_strategy_that_tiles_stays_out_of_memory(cfg: Path, capsys):
    """Only ``zero`` (no ``mlp_tiles_support``): the fallback pass runs, offers it nothing, and the
    plan says nothing fits, tiles tried."""
    from disagg.cli.main import main

    assert main(_argv(cfg, LONG, "zero")) == 1
    text = capsys.readouterr().out
    assert "(no layout fits, also with mlp_tiles: auto)" in text and "mlp_tiles=" not in text
    result = _plan(cfg, LONG, ("zero",), prune=True, tiles=True)
    assert result.tiled and result.oom and not [x for x in result.oom if _tiled(x)]


def test_prune_drops_tiles_an_untiled_twin_beats(cfg: Path):
    """In the fallback pass, a layout one of whose tiled groups could go untiled with the layout
    still fitting and ranking ahead is left out (and the best is the unpruned best)."""
    from disagg.plan.dominance import rank_key

    full = _plan(cfg, LONG, ("ddp",), tiles=True)
    pruned = _plan(cfg, LONG, ("ddp",), prune=True, tiles=True)
    assert full.tiled and pruned.tiled and rank_key(pruned.best) == rank_key(full.best)
    fitting = {x.name(): rank_key(x) for x in full.ranked}
    beaten = 0
    for x in full.ranked:
        for m in _tiled(x):
            twin = (
                x.name()
                .replace(f"{m}=ddp(1x1,mlp_tiles=auto,", f"{m}=ddp(1x1,")
                .replace(f"{m}=ddp(1x1,mlp_tiles=auto)", f"{m}=ddp(1x1)")
            )
            if twin in fitting and fitting[twin] < rank_key(x):
                beaten += 1
                assert x.name() not in {y.name() for y in pruned.ranked}, x.name()
    assert beaten and len(pruned.ranked) < len(full.ranked)


def test_tiles_are_lowered_like_offload():
    """Dominance (:mod:`disagg.plan.dominance`): a tiled group's lesser twin is the untiled one."""
    from disagg.plan.dominance import canonical, level, lowered

    tiled = (("mlp_tiles", "auto"), ("offload", "optimizer"), ("recompute", "full"))
    assert level(tiled) == 2 and level((("mlp_tiles", 1),)) == 0
    assert sorted(lowered(tiled)) == sorted(
        [(("mlp_tiles", "auto"), ("recompute", "full")), (("offload", "optimizer"), ("recompute", "full"))]
    )
    assert canonical((("mlp_tiles", 1), ("recompute", "full"))) == (("recompute", "full"),)
