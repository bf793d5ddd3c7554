"""A frozen Qwen2.5-VL tower as a feature service (``parallel.vision.feature_cache``), the LLM
under Megatron TP 2, 3 epochs of the mixed real-data-shaped set (images of three sizes, a
two-image sample, text-only samples and a text-only step; 2 microbatches, weight decay on):

- ``host`` and ``disk`` runs equal the uncached run at every step, exactly: the loss, the
  global gradient norm and every parameter (each step's checkpoint);
- after epoch 1 the tower runs no forward (counted on its ranks) and its busy time per step
  falls under 5% of epoch 1's;
- a resume from a checkpoint with the disk cache runs the tower on no cached sample;
- another ``data.max_pixels`` or other tower weights miss every entry (counted);
- the LLM under LoRA (``train.modules.llm.lora``) with a ``disk`` cache over 3 epochs equals
  its uncached run at every step; its cache dir is the one the full-LLM runs left, under
  another ``data.max_pixels``: step 1 misses every entry (the pixel-limit check), then the
  tower runs in epoch 1 only.

Seven ``run_training`` start-ups share the module's Ray session: the uncached full-LLM
reference (every full-LLM case compares with it), host, disk epoch 1 and its resume, other
tower weights, and the LoRA pair.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("disagg_llm_tp")

from mixed_data import make_mixed_tiny, mixed_config  # noqa: E402

from disagg.runtime.actor.state import read_module_state  # noqa: E402

EPOCH = 3  # steps per epoch: 12 samples, batch 4
STEPS = 3 * EPOCH
#: samples with images per epoch, and how many distinct (the set repeats three of them)
IMAGE_SAMPLES, DISTINCT = 5, 4
TP2 = {"strategy": "megatron_tp", "degree": 2}
LLM_LORA = {"r": 4, "alpha": 16, "targets": ["q_proj", "v_proj"]}
#: resizes none of the images (the processor's own limits are 3136..12544 and every image
#: lands at or under 4704), so only the settings in the key tell its entries apart
OTHER_MAX_PIXELS = 6272


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_mixed_tiny(tmp_path_factory.mktemp("tiny"), "qwen2_5_vl")


def _config(tiny: dict, out: Path, cache: dict | None, steps: int = STEPS, lora: bool = False, **extra):
    model = {m: {"family": "qwen2_5_vl", "path": tiny["models"]["qwen2_5_vl"]} for m in ("vision", "llm")}
    vision = {"strategy": "ddp", **(cache or {})}
    data = {**tiny, **extra.pop("data", {})}
    modules = {"vision": {"freeze": True}, **({"llm": {"lora": LLM_LORA}} if lora else {})}
    cfg = mixed_config(
        model, {"vision": vision, "llm": TP2}, data, out, steps, checkpoint_every=1, modules=modules, **extra
    )
    if "max_pixels" in data:
        cfg.data.max_pixels = data["max_pixels"]
    return cfg


def _run(cfg) -> list[dict]:
    from disagg.config.validate import validate
    from disagg.plugins import get_registry
    from disagg.runtime.run import run_training

    run_training(validate(cfg, get_registry()), progress=False)
    lines = (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def _params(run: Path, step: int) -> dict[str, dict[str, torch.Tensor]]:
    return {m: read_module_state(run / "checkpoints" / f"step-{step}", m)[0] for m in ("vision", "llm")}


@pytest.fixture(scope="module")
def uncached(ray_local, tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("uncached")
    return out, _run(_config(tiny, out, None))


def _assert_equal_runs(run: Path, records: list[dict], ref: Path, ref_records: list[dict], steps) -> None:
    by_step = {r["step"]: r for r in ref_records}
    for r in records:
        want = by_step[r["step"]]
        assert (r["loss"], r["grad_norm"]) == (want["loss"], want["grad_norm"]), f"step {r['step']}"
    for step in steps:
        got, want = _params(run, step), _params(ref, step)
        for m in want:
            assert got[m].keys() == want[m].keys()
            for name, t in want[m].items():
                assert torch.equal(got[m][name], t), f"step {step}: {m} {name} differs from the uncached run"


def _calls(records: list[dict]) -> list[int]:
    return [r["encode_calls_per_rank"]["vision"] for r in records]


def _busy(records: list[dict]) -> float:
    """The tower's encoder busy time per step (its step bookkeeping, ~1 ms, left out)."""
    return sum(r["encode_busy_s"]["vision"] for r in records) / len(records)


def test_host_cache_equals_uncached_and_skips_the_tower_after_epoch_1(tiny, uncached, tmp_path):
    ref, ref_records = uncached
    # the tower also works one batch ahead: during step k it encodes step k+1's new images
    records = _run(_config(tiny, tmp_path / "host", {"feature_cache": "host", "feature_cache_ahead": 1}))
    _assert_equal_runs(tmp_path / "host", records, ref, ref_records, range(1, STEPS + 1))
    assert all(_calls(ref_records)[s] > 0 for s in (0, 2, 3, 5, 6, 8)), "the uncached tower runs every epoch"
    assert _calls(records)[EPOCH:] == [0] * (2 * EPOCH)
    assert _calls(records)[1] > 0, "step 2 (text only) encodes step 3's images ahead"
    # only step 1 waits for the tower (2 image samples); every later image was ready in time
    assert [r["cache_misses"]["vision"] for r in records] == [2] + [0] * (STEPS - 1)
    assert sum(r["cache_hits"]["vision"] for r in records) == 3 * IMAGE_SAMPLES - 2
    assert 0 < records[-1]["cache_bytes"]["vision"] <= 1e9
    assert _busy(records[EPOCH : 2 * EPOCH]) < 0.05 * _busy(records[:EPOCH])


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Path:
    """The full-LLM disk runs' cache dir, which the LoRA case then reads under other settings."""
    return tmp_path_factory.mktemp("features")


def test_disk_cache_equals_uncached_and_a_resume_reuses_it(tiny, uncached, disk_dir, tmp_path):
    ref, ref_records = uncached
    cache = {"feature_cache": "disk", "feature_cache_dir": str(disk_dir)}
    # epoch 1 one batch ahead: its checkpoints must still name the trained batches' end
    first = _run(_config(tiny, tmp_path / "disk", {**cache, "feature_cache_ahead": 1}, steps=EPOCH))
    assert [r["cache_misses"]["vision"] for r in first] == [2, 0, 0]
    # a new run (new groups, new driver; not ahead) resumes at the end of epoch 1 from the files alone
    # (epoch 2 only: the host case runs all three epochs)
    cfg = _config(tiny, tmp_path / "disk", cache, steps=2 * EPOCH)
    cfg.checkpoint.resume_from = str(tmp_path / "disk" / "checkpoints" / f"step-{EPOCH}")
    resumed = _run(cfg)[EPOCH:]
    assert [r["step"] for r in resumed] == list(range(EPOCH + 1, 2 * EPOCH + 1))
    _assert_equal_runs(tmp_path / "disk", first + resumed, ref, ref_records, range(1, 2 * EPOCH + 1))
    assert _calls(resumed) == [0] * EPOCH
    assert sum(r["cache_misses"]["vision"] for r in resumed) == 0
    assert sum(r["cache_hits"]["vision"] for r in resumed) == IMAGE_SAMPLES

    # other tower weights: every entry misses (step 1: two image samples); another pixel
    # limit: the LoRA case (test_lora_llm_with_a_disk_cache_equals_its_uncached_run)
    other = _other_tower(Path(tiny["models"]["qwen2_5_vl"]), tmp_path / "other")
    cfg = _config(tiny, tmp_path / "reweighted", cache, steps=1)
    cfg.model.vision.path = str(other)
    reweighted = _run(cfg)
    assert (reweighted[0]["cache_misses"]["vision"], reweighted[0]["cache_hits"]["vision"]) == (2, 0)


def test_lora_llm_with_a_disk_cache_equals_its_uncached_run(tiny, disk_dir, tmp_path):
    """The LLM under LoRA, 3 epochs: the same tensors reach it with the cache as without."""
    cache = {"feature_cache": "disk", "feature_cache_dir": str(disk_dir)}
    if not any(disk_dir.iterdir()):  # run alone: fill the dir as the full-LLM disk case does
        _run(_config(tiny, tmp_path / "fill", cache, steps=1))
    pixels = {"max_pixels": OTHER_MAX_PIXELS}
    ref_records = _run(_config(tiny, tmp_path / "ref", None, lora=True, data=pixels))
    records = _run(_config(tiny, tmp_path / "lora", cache, lora=True, data=pixels))
    _assert_equal_runs(tmp_path / "lora", records, tmp_path / "ref", ref_records, range(1, STEPS + 1))
    assert "lora" in " ".join(_params(tmp_path / "lora", 1)["llm"]), "the LLM trains adapters"
    # the dir holds the full-LLM runs' entries, made under the processor's own pixel limit:
    # every one misses (step 1: two image samples), and the run adds its own
    assert (records[0]["cache_misses"]["vision"], records[0]["cache_hits"]["vision"]) == (2, 0)
    assert _calls(records)[EPOCH:] == [0] * (2 * EPOCH)
    assert all(_calls(ref_records)[s] > 0 for s in (0, 2, 3, 5, 6, 8)), "the uncached tower runs every epoch"
    assert sum(r["cache_hits"]["vision"] for r in records[EPOCH:]) == 2 * IMAGE_SAMPLES
    assert _busy(records[EPOCH : 2 * EPOCH]) < 0.05 * _busy(records[:EPOCH])


def _other_tower(src: Path, out: Path) -> Path:
    """The tiny dir with one tower weight nudged."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    [path] = sorted(out.glob("*.safetensors"))
    state = load_file(path)
    name = next(k for k in sorted(state) if "visual" in k and k.endswith("weight"))
    state[name] = state[name] + 1e-3
    save_file(state, path, metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(
    "cache,train,key,needles",
    [
        (
            {"feature_cache": "host"},
            {},
            "parallel.vision.feature_cache",
            ["train.modules.vision.freeze", "'host'"],
        ),
        (
            {"feature_cache": "disk"},
            {"vision": {"lora": {"targets": ["attn.qkv"]}}},
            "parallel.vision.feature_cache",
            ["LoRA", "train.modules.vision.freeze", "allowed: none, host, disk"],
        ),
        (
            {"feature_cache": "disk", "feature_cache_dir": "{tmp}/a-file/features"},
            {"vision": {"freeze": True}},
            "parallel.vision.feature_cache_dir",
            ["a-file/features'", "is not a writable dir"],
        ),
        (
            {"feature_cache": "host", "feature_cache_gb": 1e-9},
            {"vision": {"freeze": True}},
            "parallel.vision.feature_cache_gb",
            ["1e-09 GB", "one global batch", "allowed: >="],
        ),
        (
            {"feature_cache": "host", "feature_cache_dir": "{tmp}/features"},
            {"vision": {"freeze": True}},
            "parallel.vision.feature_cache_dir",
            ["'host'", "only disk uses a dir"],
        ),
        (
            {"feature_cache_ahead": 2},
            {},
            "parallel.vision.feature_cache_ahead",
            ["2 batches", "host or disk"],
        ),
    ],
)
def test_a_cache_that_cannot_work_is_a_config_error(tiny, tmp_path, cache, train, key, needles):
    """Refused by validation, before any actor starts, naming the key, the value and what is allowed."""
    from disagg.config.errors import ConfigError
    from disagg.config.schema import Config
    from disagg.config.validate import validate
    from disagg.plugins import get_registry

    (tmp_path / "a-file").write_text("a file where the cache dir should go")
    cfg = _config(tiny, tmp_path, None)
    data = cfg.model_dump()
    data["parallel"]["vision"].update({k: str(v).replace("{tmp}", str(tmp_path)) for k, v in cache.items()})
    data["train"]["modules"] = train
    with pytest.raises(ConfigError) as err:
        validate(Config.model_validate(data), get_registry())
    [problem] = [p for p in err.value.problems if p.key == key]
    assert all(n in str(problem) for n in needles), str(problem)


def test_only_an_encoder_is_cached(tiny, tmp_path):
    from disagg.config.errors import ConfigError
    from disagg.config.schema import Config
    from disagg.config.validate import validate
    from disagg.plugins import get_registry

    data = _config(tiny, tmp_path, None).model_dump()
    data["parallel"]["llm"]["feature_cache"] = "host"
    with pytest.raises(ConfigError) as err:
        validate(Config.model_validate(data), get_registry())
    assert "parallel.llm.feature_cache" in str(err.value) and "allowed: none" in str(err.value)
