"""``train.modules.<m>.lora`` is checked before any actor starts, each problem naming its key,
the file and line, the bad value and what is allowed; a good one reaches the module's
``OptimSpec`` resolved (part names to module names and patterns)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

from disagg.config import ConfigError, load_config_and_source  # noqa: E402
from disagg.config.validate import validate  # noqa: E402
from disagg.plugins import get_registry  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from disagg.cli.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny"), ["qwen2_5_vl"])


def _cfg(tiny: dict, vision: dict, llm: dict, parallel_llm: dict | None = None) -> dict:
    path = tiny["models"]["qwen2_5_vl"]
    return {
        "model": {
            "vision": {"family": "qwen2_5_vl", "path": path},
            "llm": {"family": "qwen2_5_vl", "path": path},
        },
        "parallel": {"vision": {"strategy": "ddp"}, "llm": parallel_llm or {"strategy": "ddp"}},
        "data": {"train": tiny["data"]["train"], "media_root": tiny["media_root"], "batch_size": 2},
        "train": {"steps": 1, "modules": {"vision": vision, "llm": llm}},
    }


def _load(tmp_path: Path, cfg: dict):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    loaded, source = load_config_and_source(p)
    return validate(loaded, get_registry(), source=source), p


def _problems(tmp_path: Path, cfg: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, cfg)
    return {p.key: f"{p.where}: {p.message}" for p in info.value.problems}


def _line(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


GOOD_VISION = {"lora": {"r": 4, "targets": ["attn.qkv", "proj"], "modules_to_save": ["merger"]}}
GOOD_LLM = {"lora": {"r": 8, "alpha": 16, "dropout": 0.1, "targets": ["q_proj", "self_attn.v_proj"]}}


def test_good_lora_resolves_into_the_optim_spec(tiny, tmp_path):
    from disagg.runtime.plan import optim_for

    resolved, _ = _load(tmp_path, _cfg(tiny, GOOD_VISION, GOOD_LLM))
    cfg = resolved.config
    v = optim_for(cfg, "vision", resolved.modules["vision"].family).lora
    assert (v.r, v.alpha, v.targets, v.modules_to_save, v.save_patterns) == (
        4,
        16.0,
        ("attn.qkv", "proj"),
        ("merger",),
        ("merger.*",),
    )
    llm = optim_for(cfg, "llm", resolved.modules["llm"].family).lora
    assert (llm.r, llm.dropout, llm.targets, llm.modules_to_save) == (
        8,
        0.1,
        ("q_proj", "self_attn.v_proj"),
        (),
    )


@pytest.mark.parametrize(
    "vision,llm,parallel_llm,key,needles",
    [
        (
            {},
            {"lora": {"targets": ["q_prj"]}},
            None,
            "train.modules.llm.lora.targets.0",
            ["'q_prj' matches none of family 'qwen2_5_vl'", "(did you mean 'q_proj'?)", "v_proj"],
        ),
        (
            # the tower's attention is one fused qkv: a q_proj target there matches nothing
            {"lora": {"targets": ["attn.q_proj"]}},
            {},
            None,
            "train.modules.vision.lora.targets.0",
            ["'attn.q_proj' matches none", "qkv"],
        ),
        (
            {},
            {"lora": {"r": 0, "targets": ["q_proj"]}},
            None,
            "train.modules.llm.lora.r",
            ["0 is not a LoRA rank"],
        ),
        ({}, {"lora": {"r": -2, "targets": ["q_proj"]}}, None, "train.modules.llm.lora.r", ["-2", "> 0"]),
        (
            {"lora": {"targets": ["qkv"], "modules_to_save": ["mergr"]}},
            {},
            None,
            "train.modules.vision.lora.modules_to_save.0",
            ["unknown part 'mergr'", "(did you mean 'merger'?)"],
        ),
        (
            # the merger's first linear, inside the part trained in full
            {"lora": {"targets": ["qkv", "mlp.0"], "modules_to_save": ["merger"]}},
            {},
            None,
            "train.modules.vision.lora.targets.1",
            ["'mlp.0' matches merger.mlp.0, inside part 'merger' of modules_to_save"],
        ),
        (
            {"freeze": ["tower"], "lora": {"targets": ["qkv"]}},
            {},
            None,
            "train.modules.vision.freeze",
            ["set together with lora", "modules_to_save"],
        ),
        (
            {},
            # megatron_tp adapts the column and row linears it splits; lm_head is its vocab-parallel output
            {"lora": {"targets": ["q_proj", "lm_head"]}},
            {"strategy": "megatron_tp", "degree": 2},
            "train.modules.llm.lora.targets.1",
            ["'lm_head' names output linears", "strategy 'megatron_tp' cannot adapt", "column, row"],
        ),
    ],
)
def test_bad_lora_is_refused_naming_key_file_and_line(
    tiny, tmp_path, vision, llm, parallel_llm, key, needles
):
    cfg = _cfg(tiny, vision, llm, parallel_llm)
    found = _problems(tmp_path, cfg)
    assert key in found, found
    text = found[key]
    for needle in needles:
        assert needle in text, text
    # located: the file and the line the key is on
    leaf = key.split(".")[-1]
    path = tmp_path / "c.yaml"
    where = text.split(": ", 1)[0]
    assert where.startswith(f"{path}:"), text
    if not leaf.isdigit():
        assert int(where.rsplit(":", 1)[1]) == _line(path, f"{leaf}:"), text


def test_lora_without_peft_is_refused_with_the_install_line(tiny, tmp_path, monkeypatch):
    import disagg.config.lora_checks as checks

    monkeypatch.setattr(checks, "peft_available", lambda: False)
    found = _problems(tmp_path, _cfg(tiny, {}, GOOD_LLM))
    assert "pip install 'disagg-core[lora]'" in found["train.modules.llm.lora"], found
    # and in the actor, the same line rather than a bare ImportError
    from disagg.kit.lora import require_peft

    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match=r"disagg-core\[lora\]"):
        require_peft()


@pytest.mark.parametrize(
    "patch,key,needles",
    [
        (
            # a strategy that states it cannot train adapters (a third party's, say)
            ("disagg.builtin.ddp:DDPStrategy", "lora_support", False),
            "train.modules.llm.lora",
            ["strategy 'ddp' (parallel.llm.strategy) cannot train LoRA adapters", "remove lora"],
        ),
        (
            # a family whose layer map names no linear: its targets cannot be checked
            ("disagg_llm_tp.families.qwen2_5_vl:Qwen25VLLanguageFamily", "layer_map", lambda self: None),
            "train.modules.llm.lora.targets",
            ["family 'qwen2_5_vl' documents no linear layers"],
        ),
    ],
)
def test_lora_on_a_strategy_or_family_that_cannot_adapt_is_refused(
    tiny, tmp_path, monkeypatch, patch, key, needles
):
    import importlib

    where, attr, value = patch
    mod, _, cls = where.partition(":")
    monkeypatch.setattr(getattr(importlib.import_module(mod), cls), attr, value)
    found = _problems(tmp_path, _cfg(tiny, {}, GOOD_LLM))
    assert key in found, found
    for needle in needles:
        assert needle in found[key], found[key]
