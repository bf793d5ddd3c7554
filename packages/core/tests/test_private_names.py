"""The private names of transformers, huggingface_hub and Ray that core (and the vision/audio
families through it) uses, checked against the installed releases: one that a release drops fails
here by name (``transformers`` is bounded ``<6``; the plugins' backends have their own tests)."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

#: "module:attr path" -> what uses it
HAS = {
    "transformers:PreTrainedModel._from_config": "interfaces/hf.empty_from_config (meta-device build)",
    "huggingface_hub.serialization._base:parse_size_to_int": "runtime/hf_shards (export's shard size)",
}
#: module -> names its source must mention (instance attributes it sets or reads)
MENTIONS = {
    "transformers.configuration_utils": ("_attn_implementation",),  # ulysses swaps the attention
    "transformers.modeling_utils": ("_is_hf_initialized", "_gradient_checkpointing_func"),
    "ray.actor": ("_actor_id",),  # orchestrator names a dead actor's rank
    "torch.autograd.profiler": ("kineto_results",),  # testing/allocator reads the memory records
}


def missing() -> list[str]:
    out = []
    for where in HAS:
        module, _, path = where.partition(":")
        obj: object = importlib.import_module(module)
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            out.append(where)
    for module, names in MENTIONS.items():
        source = inspect.getsource(importlib.import_module(module))
        out += [f"{module}.{n}" for n in names if not re.search(rf"\b{n}\b", source)]
    return out


def test_every_private_name_is_there() -> None:
    assert not missing(), f"gone from the installed releases: {missing()}"


def test_a_dropped_name_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    monkeypatch.delattr(transformers.PreTrainedModel, "_from_config")
    assert missing() == ["transformers:PreTrainedModel._from_config"]
