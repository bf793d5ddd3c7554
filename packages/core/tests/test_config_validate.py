"""Actor-free checks against the plugins and the file system, all problems at once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from disagg.config import ConfigError, load_config_and_source
from disagg.config.resolved import ResolvedConfig
from disagg.config.validate import validate
from disagg.plugins import get_registry, install_command, register_plugin

sys.path.insert(0, str(Path(__file__).parent))
import disagg_cfgtest_plugin  # noqa: E402


@pytest.fixture
def reg(disagg_registry):
    return register_plugin(disagg_cfgtest_plugin, name="cfgtest")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    for d in ("enc", "llm", "media"):
        (tmp_path / d).mkdir()
    (tmp_path / "d.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def base() -> dict:
    return {
        "model": {
            "vision": {"family": "cfgtest", "path": "enc"},
            "llm": {"family": "cfgtest", "path": "llm"},
        },
        "parallel": {
            "vision": {"strategy": "cfgtest_sp", "degree": 2, "replicas": 1},
            "llm": {"replicas": 2},
        },
        "data": {"train": "d.jsonl", "media_root": "media", "batch_size": 4},
        "train": {"steps": 2, "microbatches": 2},
    }


def check(workdir: Path, cfg: dict, overrides: list[str] = ()):
    p = workdir / "c.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    loaded, source = load_config_and_source(p, list(overrides))
    return validate(loaded, get_registry(), source=source)


def problems(workdir: Path, cfg: dict, overrides: list[str] = ()) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        check(workdir, cfg, overrides)
    return {p.key: f"{p.where}: {p.message}" for p in info.value.problems}


def test_valid_config_resolves(reg, workdir):
    resolved = check(workdir, base())
    assert isinstance(resolved, ResolvedConfig)
    assert resolved.modules["vision"].strategy.name == "cfgtest_sp"
    assert resolved.modules["vision"].options.chunks == 1
    assert resolved.modules["llm"].family.path == Path("llm")
    assert resolved.modules["vision"].role == "encoder" and resolved.modules["llm"].role == "llm"


def test_many_problems_are_collected(reg, workdir):
    cfg = base()
    cfg["parallel"]["vision"].update(degree=3, chunkz=2)
    cfg["parallel"]["llm"].update(strategy="ddp", degree=2, ranks=3)
    cfg["parallel"]["transport"] = "object-store"
    cfg["parallel"]["audio"] = {"degree": 2}
    cfg["model"]["llm"]["path"] = "missing-llm"
    cfg["data"]["train"] = "missing.jsonl"
    cfg["data"]["batch_size"] = 1
    cfg["train"]["modules"] = {"audio": {"freeze": True}}
    cfg["train"]["scheduler"] = "cosin"
    found = problems(workdir, cfg)
    assert set(found) == {
        "parallel.vision.chunkz",
        "parallel.llm.ranks",
        "parallel.transport",
        "parallel.audio",
        "model.llm.path",
        "data.train",
        "data.batch_size",
        "train.modules.audio",
        "train.scheduler",
    }
    assert "did you mean 'chunks'" in found["parallel.vision.chunkz"]
    allowed = (
        "allowed: strategy, degree, replicas, context_parallel, ranks, resources, recompute, "
        "loss_chunk_tokens, offload, mlp_tiles, feature_cache, feature_cache_gb, feature_cache_dir, "
        "feature_cache_ahead, chunks"
    )
    assert allowed in found["parallel.vision.chunkz"]
    assert "did you mean 'object_store'" in found["parallel.transport"]
    assert "c.yaml:" in found["data.train"]


@pytest.mark.parametrize(
    ("mutate", "key", "needles"),
    [
        (
            lambda c: c["parallel"]["llm"].update(degree=2),
            "parallel.llm",
            ["strategy 'ddp'", "degree must be 1, got 2"],
        ),
        (
            lambda c: c["parallel"]["vision"].update(degree=3),
            "parallel.vision",
            ["not divisible by degree 3", "1, 2, 4"],
        ),
        (
            lambda c: c["parallel"]["vision"].update(chunks=0),
            "parallel.vision.chunks",
            ["0 is invalid", "greater than 0"],
        ),
        (
            lambda c: c["parallel"]["llm"].update(strategy="dpp"),
            "parallel.llm.strategy",
            ["unknown strategy 'dpp'", "allowed: cfgtest_sp, ddp", "did you mean 'ddp'"],
        ),
        (
            lambda c: c["model"]["vision"].update(family="cfgtst"),
            "model.vision.family",
            ["unknown encoder family 'cfgtst'", "installed encoder families: cfgtest", "did you mean"],
        ),
        (
            # another model version is no typo: no "did you mean", the installed ones listed
            lambda c: c["model"]["vision"].update(family="cfgtest2"),
            "model.vision.family",
            ["unknown encoder family 'cfgtest2'; installed encoder families: cfgtest"],
        ),
        (
            lambda c: c["model"]["vision"].update(family="whisper"),
            "model.vision.family",
            [install_command("disagg-audio")],
        ),
        (
            lambda c: c["model"]["llm"].update(family="qwen3_vl"),
            "model.llm.family",
            [install_command("disagg-llm-tp")],
        ),
        (
            lambda c: c["parallel"]["llm"].update(strategy="zero"),
            "parallel.llm.strategy",
            [install_command("disagg-zero")],
        ),
        (
            lambda c: c["model"]["vision"].update(family="llava"),
            "model.vision.family",
            [install_command("disagg-vision-sp")],
        ),
        (
            lambda c: c["data"].update(media_root="nomedia"),
            "data.media_root",
            ["'nomedia' is not a directory"],
        ),
        (
            lambda c: c.update(ray={"num_cpus": 1}),
            "ray.num_cpus",
            ["1 logical CPUs cannot hold the ranks, which reserve 4", "max(8, cores, reserved + 2)"],
        ),
    ],
)
def test_single_problem(reg, workdir, mutate, key, needles):
    cfg = base()
    mutate(cfg)
    found = problems(workdir, cfg)
    assert list(found) == [key]
    for needle in needles:
        assert needle in found[key]


def test_group_defaults_for_unconfigured_module_are_fine(reg, workdir):
    cfg = base()
    cfg["parallel"]["audio"] = {"strategy": "ddp", "degree": 1, "replicas": 1}
    assert check(workdir, cfg).modules.keys() == {"vision", "llm"}


def test_family_that_cannot_be_built_is_reported(reg, workdir, monkeypatch):
    def boom(self, path, options=None):
        raise OSError("no config.json")

    monkeypatch.setattr(disagg_cfgtest_plugin.CfgLLM, "__init__", boom)
    found = problems(workdir, base())
    assert list(found) == ["model.llm"] and "OSError: no config.json" in found["model.llm"]


def test_resume_with_other_batch_size_or_data_is_refused_before_any_actor(reg, workdir):
    """The data position is derived from the step, so a checkpoint may only be
    resumed with the batch size, data files and seed it was trained with."""
    import json

    from disagg.config.fingerprint import run_fingerprint

    ckpt = workdir / "run" / "checkpoints" / "step-2"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text("{}")
    saved = check(workdir, base()).config
    (ckpt / "meta.json").write_text(json.dumps({"step": 2, "fingerprint": run_fingerprint(saved)}))
    resume = ["checkpoint.resume_from=run/checkpoints/step-2"]
    check(workdir, base(), resume)  # the same run resumes
    got = problems(workdir, base(), [*resume, "data.batch_size=8"])
    assert "data.batch_size: the checkpoint has 4, this run has 8" in got["checkpoint.resume_from"]
    (workdir / "d.jsonl").write_text('{"other": 1}\n')
    got = problems(workdir, base(), resume)
    assert "data.train" in got["checkpoint.resume_from"] and "d.jsonl" in got["checkpoint.resume_from"]


def test_the_local_ray_is_sized_by_the_cpus_the_ranks_reserve(reg, workdir, monkeypatch):
    """Ranks reserving 2 logical CPUs each (``resources.num_cpus``) need twice the
    CPUs, or the embedded Ray would hold every one and starve Ray Data."""
    from disagg.config.resolved import reserved_cpus
    from disagg.runtime import run

    cfg = base()
    cfg["parallel"]["vision"]["resources"] = {"num_cpus": 2}
    cfg["parallel"]["llm"]["resources"] = {"num_cpus": 1.5}
    resolved = check(workdir, cfg)
    assert reserved_cpus(resolved) == 2 * 2 + 2 * 1.5  # 7 CPUs for 4 ranks
    calls = []
    monkeypatch.setattr(run.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(run.ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(run.os, "cpu_count", lambda: 2)
    run.ensure_ray(None, None, reserved=reserved_cpus(resolved))
    assert calls[0]["num_cpus"] == 9
    cfg["ray"] = {"num_cpus": 6}
    assert "reserve 7" in problems(workdir, cfg)["ray.num_cpus"]


def test_recompute_a_strategy_cannot_apply_is_refused_naming_module_and_allowed(reg, workdir):
    cfg = base()
    cfg["parallel"]["vision"]["recompute"] = "full"  # cfgtest_sp applies none
    cfg["parallel"]["llm"]["recompute"] = "selective"  # ddp applies none, full
    got = problems(workdir, cfg)
    assert (
        "strategy 'cfgtest_sp' cannot recompute 'full' for module 'vision'; allowed: none"
        in (got["parallel.vision.recompute"])
    )
    assert (
        "strategy 'ddp' cannot recompute 'selective' for module 'llm'; allowed: none, full"
        in (got["parallel.llm.recompute"])
    )
    assert "c.yaml" in got["parallel.llm.recompute"]  # names the file (and line)
    cfg["parallel"]["llm"]["recompute"] = "sometimes"
    cfg["parallel"]["vision"].pop("recompute")
    assert "none" in problems(workdir, cfg)["parallel.llm.recompute"]


def test_recompute_reaches_the_strategy_options(reg, workdir):
    cfg = base()
    cfg["parallel"]["llm"]["recompute"] = "full"
    resolved = check(workdir, cfg)
    assert resolved.modules["llm"].options.recompute == "full"
    assert resolved.modules["vision"].options.recompute == "none"


def test_loss_chunk_tokens_reaches_the_llm_and_is_refused_elsewhere(reg, workdir):
    cfg = base()
    cfg["parallel"]["llm"]["loss_chunk_tokens"] = 256
    resolved = check(workdir, cfg)
    assert resolved.modules["llm"].options.loss_chunk_tokens == 256
    cfg["parallel"]["llm"]["loss_chunk_tokens"] = None  # the whole microbatch at once
    assert check(workdir, cfg).modules["llm"].options.loss_chunk_tokens is None
    cfg["parallel"]["vision"]["loss_chunk_tokens"] = 1024  # the default, as a resolved config dump holds it
    check(workdir, cfg)
    cfg["parallel"]["vision"]["loss_chunk_tokens"] = 64
    got = problems(workdir, cfg)
    assert "only the language model computes the loss" in got["parallel.vision.loss_chunk_tokens"]
    assert "c.yaml" in got["parallel.vision.loss_chunk_tokens"]
    cfg["parallel"]["vision"].pop("loss_chunk_tokens")
    cfg["parallel"]["llm"]["loss_chunk_tokens"] = 0
    assert "greater than 0" in problems(workdir, cfg)["parallel.llm.loss_chunk_tokens"]


def test_shard_modes_refused_by_name_where_they_cannot_run(reg, workdir):
    """``parallel.<m>.shard`` (ddp here): FSDP modes shard the LLM too (its empty replicas run a
    placeholder sample), no sharded state is combined with overlap_grad_reduce; a bad value
    lists the allowed ones."""
    cfg = base()
    cfg["parallel"]["llm"].update(shard="parameters")
    assert check(workdir, cfg).config.parallel.llm.shard == "parameters"
    cfg["parallel"]["llm"].update(shard="parameters", overlap_grad_reduce=True)
    got = problems(workdir, cfg)["parallel.llm"]
    assert "parallel.llm.overlap_grad_reduce: true cannot be combined with" in got
    assert "parallel.llm.shard: parameters" in got
    assert "c.yaml" in got
    cfg["parallel"]["llm"].update(shard="optimizer", overlap_grad_reduce=True)
    got = problems(workdir, cfg)["parallel.llm"]
    assert "parallel.llm.overlap_grad_reduce: true cannot be combined with" in got
    assert "parallel.llm.shard: optimizer" in got
    cfg["parallel"]["llm"].update(shard="everything", overlap_grad_reduce=False)
    got = problems(workdir, cfg)["parallel.llm.shard"]
    assert "'everything' is not allowed; allowed: none, optimizer, gradients, parameters" in got
    cfg["parallel"]["llm"].update(shard="optimizer")
    assert check(workdir, cfg).config.parallel.llm.shard == "optimizer"


def test_train_dtype_is_refused_naming_train_precision_and_the_mapping(reg, workdir):
    cfg = base()
    cfg["train"]["dtype"] = "bfloat16"
    got = problems(workdir, cfg)["train.dtype"]
    assert "c.yaml" in got and "replaced by train.precision" in got
    assert "float32 -> fp32" in got and "bfloat16 -> bf16" in got


def test_a_recipe_a_strategy_does_not_honour_is_refused_before_any_actor(reg, workdir):
    """``train.precision`` against ``Strategy.precisions`` (cfgtest_sp lists only fp32): the key,
    the module, the strategy and what it honours; ``auto`` on a known device is resolved first."""

    def refusals(cfg: dict) -> str:
        with pytest.raises(ConfigError) as info:
            check(workdir, cfg)
        assert {p.key for p in info.value.problems} == {"train.precision"}, info.value.problems
        return "\n".join(f"{p.where}: {p.message}" for p in info.value.problems)

    cfg = base()
    cfg["train"]["precision"] = "bf16-pure"
    msg = refusals(cfg)
    assert "c.yaml" in msg
    assert "'bf16-pure' is not honoured by strategy 'cfgtest_sp' of module 'vision'" in msg
    assert "(parallel.vision.strategy); it honours: fp32;" in msg
    cfg["train"].update(precision="auto", device="cuda")
    msg = refusals(cfg)
    assert "auto (resolved to 'bf16' on cuda) is not honoured by strategy 'cfgtest_sp'" in msg
    cfg["train"].update(precision="fp32", device="auto")
    assert check(workdir, cfg).config.train.precision == "fp32"
    cfg["train"]["precision"] = "half"
    got = problems(workdir, cfg)["train.precision"]
    assert "'half' is not allowed; allowed: auto, fp32, bf16, bf16-pure" in got


def test_auto_precision_on_an_auto_device_is_checked_by_the_plan(reg, workdir):
    from disagg.runtime.plan import make_plan

    resolved = check(workdir, base())  # device and precision auto: validation cannot tell yet
    with pytest.raises(ConfigError) as info:
        make_plan(resolved, get_registry(), cluster_gpus=8)
    assert "train.precision" in str(info.value) and "'cfgtest_sp'" in str(info.value)


def test_schema_and_plugin_problems_come_in_one_pass(reg, workdir):
    """A refused value (the schema's check) and an unknown strategy (a check that needs the
    plugins) in one config: ``load_checked`` reports both, each located, and nothing about
    the refused key's default; ``disagg train`` prints both and exits 2."""
    from disagg.cli.main import main
    from disagg.config.validate import load_checked

    cfg = base()
    cfg["train"]["lr"] = -1
    cfg["train"]["lrr"] = 1
    cfg["parallel"]["llm"]["strategy"] = "no_such_strategy"
    cfg["parallel"]["vision"]["degree"] = 0
    p = workdir / "c.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with pytest.raises(ConfigError) as info:
        load_checked(p, ["train.steps=0"], get_registry())
    found = {x.key: x for x in info.value.problems}
    assert set(found) == {
        "train.lr",
        "train.lrr",
        "train.steps",
        "parallel.vision.degree",
        "parallel.llm.strategy",
    }
    assert "no_such_strategy" in found["parallel.llm.strategy"].message
    assert found["parallel.llm.strategy"].where.startswith(f"{p}:")
    assert found["train.steps"].where == "--set train.steps=0"
    assert main(["train", str(p)]) == 2
    p.write_text(yaml.safe_dump(base(), sort_keys=False))  # a sound config comes back as loaded
    loaded, source = load_checked(p, [], get_registry())
    assert loaded.parallel.vision.strategy == "cfgtest_sp" and source.where(("train", "steps"))


def test_offload_reaches_the_strategy_and_is_refused_with_overlap(reg, workdir):
    """``parallel.<m>.offload`` (core's key, issue 38) is passed to the strategy's options; with
    ``overlap_grad_reduce`` it is refused before any actor starts, naming both keys."""
    cfg = base()
    cfg["parallel"]["llm"].update(strategy="ddp", offload="optimizer")
    assert check(workdir, cfg).modules["llm"].options.offload == "optimizer"
    cfg["parallel"]["llm"]["overlap_grad_reduce"] = True
    got = "\n".join(problems(workdir, cfg).values())
    assert "offload: optimizer cannot be combined with overlap_grad_reduce: true" in got, got
    cfg["parallel"]["llm"].update(offload="disk", overlap_grad_reduce=False)
    got = problems(workdir, cfg)["parallel.llm.offload"]
    assert "c.yaml:" in got and "'disk' is not allowed; allowed: none, optimizer" in got, got


def test_activation_offload_needs_full_recompute(reg, workdir):
    """``offload: activations | all`` moves what ``recompute: full`` keeps: accepted with it (and
    ``all`` means the optimizer's too), refused without it before any actor starts, naming the
    keys and the allowed values."""
    cfg = base()
    cfg["parallel"]["llm"].update(strategy="ddp", offload="all", recompute="full")
    assert check(workdir, cfg).modules["llm"].options.offload == "all"
    cfg["parallel"]["llm"].update(offload="activations", recompute="selective")
    got = "\n".join(problems(workdir, cfg).values())
    assert "offload: activations moves the inputs that recompute: full keeps" in got, got
    assert "recompute is 'selective'" in got and "c.yaml" in got, got
    cfg["parallel"]["llm"].update(offload="all", recompute="full", overlap_grad_reduce=True)
    got = "\n".join(problems(workdir, cfg).values())
    assert "offload: optimizer cannot be combined with overlap_grad_reduce: true" in got, got


def test_mlp_tiles_refused_by_strategy_family_and_value(reg, workdir):
    """``parallel.<m>.mlp_tiles`` (:mod:`disagg.kit.recompute.tiled_mlp`): a strategy without
    ``mlp_tiles_support`` (``cfgtest_sp``) and a family that declares no MLP modules (``cfgtest``,
    under ``ddp``) are refused naming the key and what is allowed; so is a value that is neither a
    positive int nor ``auto``; 1 (off) is fine everywhere."""
    cfg = base()
    cfg["parallel"]["vision"]["mlp_tiles"] = 4
    cfg["parallel"]["llm"]["mlp_tiles"] = "auto"
    cfg["parallel"]["llm"]["strategy"] = "ddp"
    got = problems(workdir, cfg)
    assert "strategy 'cfgtest_sp' does not run sequence-tiled MLPs" in got["parallel.vision.mlp_tiles"]
    assert "allowed: 1, or strategy ddp, ulysses, megatron_tp" in got["parallel.vision.mlp_tiles"]
    assert "declares no per-token MLP modules (LayerMap.mlp)" in got["parallel.llm.mlp_tiles"]
    assert "c.yaml" in got["parallel.llm.mlp_tiles"]
    cfg["parallel"]["vision"]["mlp_tiles"] = 1
    cfg["parallel"]["llm"]["mlp_tiles"] = 0
    got = problems(workdir, cfg)["parallel.llm.mlp_tiles"]
    assert "0 is not a number of tiles; allowed: a positive integer (1: off) or 'auto'" in got
    cfg["parallel"]["llm"].pop("mlp_tiles")
    assert check(workdir, cfg).modules["vision"].options.mlp_tiles == 1


def test_a_family_newer_than_the_installed_transformers_is_refused_naming_both(reg, workdir, monkeypatch):
    """A family whose HF model class changed after core's transformers floor declares its own
    (``requires_transformers``): an older release is a config error at ``model.<m>.family``,
    file and line, naming both releases, before any actor (not a rank's failure in forward)."""
    from importlib.metadata import version

    have = version("transformers")
    major = int(have.split(".")[0])
    floor = (f"{major + 1}.0", "its model class changed")
    monkeypatch.setattr(disagg_cfgtest_plugin.CfgLLM, "requires_transformers", floor, raising=False)
    found = problems(workdir, base())
    assert list(found) == ["model.llm.family"], found
    msg = found["model.llm.family"]
    assert "c.yaml:" in msg and f"transformers>={major + 1}.0" in msg and have in msg, msg
    assert "its model class changed" in msg
    # at or under the installed release: nothing to say
    monkeypatch.setattr(disagg_cfgtest_plugin.CfgLLM, "requires_transformers", (have, "x"))
    assert isinstance(check(workdir, base()), ResolvedConfig)
