"""``disagg plan`` and ``parallel: auto`` on a config consider ``parallel.llm.context_parallel``
and ``offload: optimizer``, costed by the strategies' own hooks (:mod:`disagg.plan.native`):

- on the tiny Qwen2.5-VL with a device memory between what the smallest layout with context
  parallelism needs and what the smallest without it needs, the plan picks CP, says so and why,
  and writes a config validation accepts; likewise for optimizer offload on one device, through
  ``parallel: auto``; with room to spare neither is picked (offload costs the host AdamW's time);
- on Qwen2.5-VL-32B's config values (the published setting) on 8 x H100 the plan lists TP x CP
  and data-parallel + CP layouts for the LLM, each group ``degree x context_parallel x replicas``
  ranks, never CP beside sequence parallelism (validation refuses the pair); on Qwen3-VL-8B, whose
  family cannot split its sequence, it lists no CP but offload.

Config values and cost hooks only: no weights, no actor."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

FAMILY = "qwen2_5_vl"
GiB = 2**30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from disagg.cli.make_tiny import make_tiny

    root = tmp_path_factory.mktemp("plancp")
    make_tiny(root / "tiny", [FAMILY], train_per_class=1, eval_per_class=1)
    return root


def _config(root: Path, batch: int, parallel: dict | None = None) -> dict:
    model = str(root / "tiny" / FAMILY)
    data = root / "tiny" / "data"
    return {
        "model": {m: {"family": FAMILY, "path": model} for m in ("vision", "llm")},
        "parallel": parallel or {},
        "data": {"train": str(data / "train.jsonl"), "media_root": str(data), "batch_size": batch},
        "train": {"seed": 0, "lr": 1.0e-3, "steps": 2},
        "output_dir": str(root / "run"),
    }


def _keys(layout) -> set[str]:  # type: ignore[no-untyped-def]
    """Which of the two keys a planned layout uses."""
    out = set()
    for g in layout.groups.values():
        o = dict(g.options)
        if g.context_parallel > 1:
            out.add("cp")
        if o.get("offload", "none") in ("optimizer", "all"):
            out.add("offload")
        if o.get("offload", "none") in ("activations", "all"):  # recompute's saved inputs
            out.add("actoff")
    return out


def _plan(cfg: dict, cluster, prune: bool = False, **work):  # type: ignore[no-untyped-def]
    from disagg.config.schema import Config
    from disagg.plan.search import plan
    from disagg.plan.workload import config_families, config_workload
    from disagg.plugins import get_registry

    reg = get_registry()
    c = Config.model_validate(cfg)
    strategies = {n: reg.strategies[n] for n in work.pop("strategies", reg.strategies)}
    workload = config_workload(c, registry=reg, **work)
    return plan(workload, cluster, strategies, config_families(c, reg), prune=prune)


def _between(result, picks: str) -> float:  # type: ignore[no-untyped-def]
    """A device memory (bytes, before the usable fraction) that the smallest layout using
    ``picks`` fits and no layout without it does."""
    layouts = result.ranked + result.oom
    need = min(x.memory_bytes for x in layouts if _keys(x) == {picks})
    without = min(x.memory_bytes for x in layouts if picks not in _keys(x))
    assert need < without, (picks, need, without)
    return (need + without) / 2 / result.cluster.usable


def _validated(root: Path, written: dict, batch: int):  # type: ignore[no-untyped-def]
    """The train config with the plan's sections merged in, as validation resolves it."""
    from disagg.config.load import load_config
    from disagg.config.validate import validate
    from disagg.plugins import get_registry

    merged = _config(root, batch, written["parallel"])
    merged["train"].update(written["train"])
    path = root / f"merged-{len(list(root.glob('merged-*')))}.yaml"
    path.write_text(yaml.safe_dump(merged))
    return validate(load_config(path), get_registry())


def test_tight_memory_picks_context_parallel(tiny: Path, capsys):
    """4 GPUs, 4 samples of 2M text tokens, the LLM under ddp: only CP splits a sample's
    activations, so between the two minima only CP layouts fit."""
    from disagg.cli.main import main
    from disagg.plan.cluster import cluster_from

    cfg = _config(tiny, 4)
    work = {"text_tokens": 2_000_000, "strategies": ["ddp", "ulysses"]}
    roomy = _plan(cfg, cluster_from("h100x8", {"gpus": 4}), **work)
    assert "offload" not in _keys(roomy.best)  # everything fits: offload would only add time
    cp = [x for x in roomy.ranked + roomy.oom if "cp" in _keys(x)]
    assert cp and all(
        g.ranks == g.degree * g.context_parallel * g.replicas and g.ranks <= 4
        for x in cp
        for g in x.groups.values()
    )
    assert {x.groups["llm"].context_parallel for x in cp} == {2, 4}
    mem = _between(roomy, "cp")
    (tiny / "cp.yaml").write_text(yaml.safe_dump(cfg))
    out = tiny / "cp-plan.yaml"
    argv = ["plan", str(tiny / "cp.yaml"), "--cluster", "h100x8", "--gpus", "4", "--gpu-mem", str(int(mem))]
    assert main([*argv, "--text-tokens", "2000000", "--strategies", "ddp,ulysses", "--write", str(out)]) == 0
    text = capsys.readouterr().out
    assert (
        "uses llm: context_parallel=" in text
        and "context_parallel wins on memory: nothing without it fits" in text
    )
    written = yaml.safe_load(out.read_text())
    llm = written["parallel"]["llm"]
    assert llm["context_parallel"] > 1 and "offload" not in llm
    resolved = _validated(tiny, written, 4)
    assert resolved.modules["llm"].context_parallel == llm["context_parallel"]
    assert resolved.modules["llm"].size == llm["degree"] * llm["context_parallel"] * llm["replicas"]


def test_tight_memory_picks_offload_through_parallel_auto(tiny: Path):
    """1 GPU (no sharding, no CP): only optimizer offload shrinks the state; ``parallel: auto`` on
    a cluster between the two minima places an offloaded layout that validation accepts."""
    from disagg.config.schema import Config
    from disagg.plan.auto import resolve_auto
    from disagg.plan.cluster import cluster_from, save_cluster
    from disagg.plugins import get_registry

    cfg = _config(tiny, 1)
    roomy = _plan(cfg, cluster_from("h100x8", {"gpus": 1}), text_tokens=128, vision_patches=1024)
    assert "offload" not in _keys(roomy.best)
    offloaded = [x for x in roomy.ranked if _keys(x) == {"offload"}]
    twin = {x.name(): x for x in roomy.ranked}
    # the same layout without offload is faster: the host AdamW's exposed seconds
    for x in offloaded[:20]:
        plain = x.name().replace("offload=optimizer,", "")
        if plain in twin:
            assert twin[plain].step_time_s < x.step_time_s, x.name()
            assert any(t.get("offload_s", 0) > 0 for t in x.times.values())
    # likewise recompute's saved inputs in host memory: their copies' seconds
    moved = [x for x in roomy.ranked if _keys(x) == {"actoff"}]
    assert moved, "offload: activations is offered beside recompute: full on a GPU cluster"
    for x in moved[:20]:
        plain = re.sub(r"offload=activations,", "", x.name())
        if plain in twin:
            assert twin[plain].step_time_s < x.step_time_s, x.name()
            assert any(t.get("activation_offload_s", 0) > 0 for t in x.times.values())
    tight = cluster_from("h100x8", {"gpus": 1, "gpu_mem": str(int(_between(roomy, "offload")))})
    path = save_cluster(tight, tiny / "tight.json")
    auto = {"cluster": str(path), "vision_tokens": 256, "text_tokens": 128}
    placed, record = resolve_auto(Config.model_validate(_config(tiny, 1, {"auto": auto})), get_registry())
    chosen = record["chosen"]["parallel"]
    assert any(chosen[m].get("offload") == "optimizer" for m in ("vision", "llm")), chosen
    assert "offload=optimizer" in record["why"][1] and record["why"][2].startswith("  offload wins on memory")
    resolved = _validated(tiny, record["chosen"], 1)
    assert {m: r.options.offload for m, r in resolved.modules.items()} == {
        m: chosen[m].get("offload", "none") for m in ("vision", "llm")
    }
    assert placed.parallel.auto is None


def _dir(tmp: Path, name: str, config: dict) -> dict:
    d = tmp / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return {"model": {m: {"family": config["model_type"], "path": str(d)} for m in ("vision", "llm")}}


def test_plan_lists_tp_x_cp_and_dp_cp_on_qwen2_5_vl_32b(tmp_path):
    """The published setting's config values (``disagg.bench.published.QWEN2_5_VL_32B``) as a
    model dir: 8 x H100, 16k vision tokens, full recompute."""
    from disagg.bench.published import QWEN2_5_VL_32B, SAMPLES, TEXT_TOKENS
    from disagg.plan.cluster import cluster_from

    cfg = {
        **_dir(tmp_path, "q32", {**QWEN2_5_VL_32B, "model_type": "qwen2_5_vl"}),
        "output_dir": str(tmp_path),
    }
    result = _plan(
        cfg,
        cluster_from("h100x8"),
        vision_tokens=16384,
        text_tokens=TEXT_TOKENS,
        samples=SAMPLES,
        recompute=True,
        strategies=["ddp", "megatron_tp", "ulysses", "zero"],
    )
    llm = {x.groups["llm"] for x in result.ranked + result.oom}
    cp = [g for g in llm if g.context_parallel > 1]
    tp_cp = {(g.degree, g.context_parallel) for g in cp if g.strategy == "megatron_tp" and g.degree > 1}
    dp_cp = {(g.context_parallel, g.replicas) for g in cp if g.strategy == "ddp"}
    assert {(2, 2), (2, 4), (4, 2)} <= tp_cp and {(2, 1), (8, 1), (2, 4)} <= dp_cp
    assert all(g.ranks == g.degree * g.context_parallel * g.replicas <= 8 for g in llm)
    assert not [
        g for g in cp if dict(g.options).get("sequence_parallel") or g.strategy in ("zero", "ulysses")
    ]
    # an offloaded CP rank's state is on the host (the strategy's CP estimate keeps host_bytes), and
    # the host AdamW's seconds are charged
    both = [
        x
        for x in result.ranked
        if x.groups["llm"].context_parallel > 1
        and dict(x.groups["llm"].options).get("offload") == "optimizer"
    ]
    assert both and all(x.costs["llm"].host_bytes > 0 and x.times["llm"]["offload_s"] > 0 for x in both)
    # 18 B of bf16 state per parameter: nothing without CP or offload fits 90% of 80 GB
    assert result.ranked and all(_keys(x) for x in result.ranked)
    assert "cp" in _keys(result.best) or "offload" in _keys(result.best)


def test_qwen3_vl_family_without_cp_gets_offload_only(tmp_path):
    from disagg.config.schema import Config
    from disagg.plan.cluster import cluster_from
    from disagg.plan.search import candidates
    from disagg.plan.workload import config_families, config_workload
    from disagg.plugins import get_registry

    config = json.loads((Path(__file__).parent / "configs" / "qwen3_vl_8b.json").read_text())
    c = Config.model_validate({**_dir(tmp_path, "q3", config), "output_dir": str(tmp_path)})
    reg = get_registry()
    work = config_workload(c, registry=reg, vision_tokens=4096, text_tokens=1024, samples=4)
    found = candidates(work, cluster_from("h100x8", {"gpus": 4}), reg.strategies, config_families(c, reg))
    llm = [g for g, _ in found.per_module["llm"]]
    assert llm and all(g.context_parallel == 1 for g in llm)
    assert {g.strategy for g in llm if dict(g.options).get("offload") == "optimizer"} >= {
        "megatron_tp",
        "ddp",
    }


def test_host_memory_per_node_bounds_offload():
    """The GPU presets' host memory (DGX 2 TB, 70% beside Ray's object store) is checked per node:
    every device of a node may hold the worst device's offloaded state."""
    from dataclasses import replace

    from disagg.plan.cluster import PRESETS
    from disagg.plan.model import Group, Layout, host_fits

    h100 = PRESETS["h100x8"]
    assert h100.host_memory == int(0.7 * 2 * 10**12) and PRESETS["cpu"].host_memory == 0
    x = Layout({"llm": Group("llm", "s", 8, 1)}, "collocated", 1, "sequential")
    x.host_bytes = h100.host_memory // 8
    assert host_fits(x, h100) and host_fits(x, PRESETS["cpu"])
    x.host_bytes += 1
    assert not host_fits(x, h100) and host_fits(x, replace(h100, host_memory=0))


#: offload values below each, ``none`` (the key left out) last
BELOW = {
    "all": ("activations", "optimizer", "none"),
    "activations": ("none",),
    "optimizer": ("none",),
    "none": (),
}


def _less_offloaded(options: tuple) -> list[tuple]:
    """The group's options with each offload key at its own value or any lower one (the first: its
    own), ``offload: none`` and ``offload_optimizer: false`` left out."""
    o = dict(options)
    rest = {k: v for k, v in o.items() if k not in ("offload", "offload_optimizer")}
    out = []
    for value in (o.get("offload", "none"), *BELOW[o.get("offload", "none")]):
        for whole in (True, False) if o.get("offload_optimizer") else (False,):
            d = {**rest, **({"offload": value} if value != "none" else {})}
            out.append(tuple(sorted({**d, **({"offload_optimizer": True} if whole else {})}.items())))
    return out


def _rank(x) -> tuple:  # type: ignore[no-untyped-def]
    """The plan's order."""
    return (round(x.step_time_s, 12), x.memory_bytes, x.name())


def _ident(x, options: tuple) -> tuple:  # type: ignore[no-untyped-def]
    """Layout ``x`` with its groups' ``options`` in place of their own."""
    groups = ((g.module, g.strategy, g.degree, g.replicas) for g in x.groups.values())
    return (x.placement, *groups, options)


def _dominated(x, fitting: dict) -> bool:  # type: ignore[no-untyped-def]
    """A less-offloaded twin of ``x`` fits (``fitting``: by :func:`_ident`) and ranks ahead of it."""
    import itertools

    mine = tuple(_less_offloaded(g.options)[0] for g in x.groups.values())
    for twin in itertools.product(*(_less_offloaded(g.options) for g in x.groups.values())):
        rank = fitting.get(_ident(x, twin))
        if twin != mine and rank is not None and rank < _rank(x):
            return True
    return False


def test_prune_leaves_out_exactly_the_layouts_a_less_offloaded_twin_beats(tiny: Path, capsys):
    """``plan(prune=True)`` (``disagg plan``, ``parallel: auto``) against the full ranking, by brute
    force: it keeps, in the same order with the same figures, exactly the layouts none of whose
    less-offloaded twins (any groups' offload lowered, any number of steps) fits and ranks ahead;
    so the best is the same. Roomy (everything fits: every offloaded layout goes) and between the
    minima (offload needed: offloaded layouts stay)."""
    from disagg.cli.main import main
    from disagg.plan.cluster import cluster_from, save_cluster

    cfg = _config(tiny, 1)
    work = {"text_tokens": 128, "vision_patches": 1024}
    roomy = cluster_from("h100x8", {"gpus": 1})
    mem = _between(_plan(cfg, roomy, **work), "offload")
    tight = cluster_from("h100x8", {"gpus": 1, "gpu_mem": str(int(mem))})
    for cluster in (roomy, tight):
        full, pruned = _plan(cfg, cluster, **work), _plan(cfg, cluster, prune=True, **work)
        own = (tuple(_less_offloaded(g.options)[0] for g in x.groups.values()) for x in full.ranked)
        fitting = {_ident(x, o): _rank(x) for x, o in zip(full.ranked, own)}
        for kept, every in ((pruned.ranked, full.ranked), (pruned.oom, full.oom)):
            assert [_rank(x) for x in kept] == [_rank(x) for x in every if not _dominated(x, fitting)]
        assert _rank(pruned.best) == _rank(full.best) and len(pruned.ranked) < len(full.ranked)
        offloaded = [x for x in pruned.ranked if _keys(x) & {"offload", "actoff"}]
        assert bool(offloaded) == (cluster is tight), len(offloaded)
    # the command line prunes unless --dominated
    (tiny / "prune.yaml").write_text(yaml.safe_dump(cfg))
    argv = ["plan", str(tiny / "prune.yaml"), "--calibration", str(save_cluster(tight, tiny / "t.json"))]
    argv += ["--text-tokens", "128", "--vision-patches", "1024", "--json", str(tiny / "prune.json")]
    for extra, want in (([], pruned), (["--dominated"], full)):
        assert main([*argv, *extra]) == 0
        got = json.loads((tiny / "prune.json").read_text())["ranked"]
        assert [r["name"] for r in got] == [x.name() for x in want.ranked]
    capsys.readouterr()
