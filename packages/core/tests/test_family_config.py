"""A family parses its dir's ``config.json`` once (``Family.hf_config``): the data pipeline asks
for it per sample and the planner per candidate, and each parse validates every field. The kept
config must not change under whoever builds a model from it."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from disagg.interfaces import LanguageFamily
from disagg.kit.hf import empty_from_config


class _Family(LanguageFamily):
    name = "config_test"

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        raise NotImplementedError

    def export_state(self, state):  # type: ignore[no-untyped-def]
        return state

    def placeholder_token_id(self, module: str) -> int:
        raise NotImplementedError

    def forward(self, module, inputs, embeds):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def _dir(tmp_path: Path) -> Path:
    Qwen2Config(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64,
    ).save_pretrained(tmp_path)  # fmt: skip
    return tmp_path


def test_parsed_once_and_carried_to_the_actors(tmp_path, monkeypatch):
    path = _dir(tmp_path)
    calls: list[object] = []
    parse = transformers.AutoConfig.from_pretrained

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args)
        return parse(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", counted)
    family = _Family(path)
    cfg = family.hf_config()
    assert family.hf_config() is cfg and cfg.hidden_size == 16
    assert len(calls) == 1
    # an instance shipped to an actor (pickled, as Ray does) brings it along
    shipped = pickle.loads(pickle.dumps(family))
    assert shipped.hf_config().hidden_size == 16 and len(calls) == 1
    # another instance (another module, another run) reads its own
    _Family(path).hf_config()
    assert len(calls) == 2


def test_building_from_it_leaves_it_unchanged(tmp_path):
    family = _Family(_dir(tmp_path))
    cfg = family.hf_config()
    before = cfg.to_dict()
    model = empty_from_config(Qwen2ForCausalLM, cfg, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"  # noqa: SLF001
    # transformers' _from_config writes attn_implementation into the config it is handed
    assert cfg.to_dict() == before and cfg._attn_implementation != "eager"  # noqa: SLF001
